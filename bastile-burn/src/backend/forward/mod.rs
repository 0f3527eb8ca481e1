//! The mechanical half of the decorator: every op of Burn's backend traits
//! forwarded to the inner backend `B`. The signature lists mirror
//! `burn-backend` 0.21.0 (the compiler checks each one against the trait);
//! the ops Bastile does better are the ones missing here and implemented
//! next to their kernels.
//!
//! `tensor.rs` forwards the float, int and bool tensor ops, `module.rs` the
//! module, activation, quantization and transaction ops.

mod module;
mod tensor;

/// Emits `fn name(args) -> Ret { B::name(args) }` for each listed signature;
/// `=> conv` converts a result that is a struct generic over the backend.
macro_rules! forward_ops {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty $(=> $conv:ident)?)?;)*) => {
        $(
            fn $name($($arg: $ty),*) $(-> $ret)? {
                forward_ops!(@call $name($($arg),*) $($($conv)?)?)
            }
        )*
    };
    (@call $name:ident($($arg:ident),*)) => { B::$name($($arg),*) };
    (@call $name:ident($($arg:ident),*) $conv:ident) => { $conv::<B>(B::$name($($arg),*)) };
}

pub(super) use forward_ops;
