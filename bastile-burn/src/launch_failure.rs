//! Kernel launches that fail after their checks passed.
//!
//! Every Bastile launcher checks its problem (dtypes, shapes, buffer sizes,
//! what the device supports) before it launches, so a launch that fails
//! anyway is a fault of the runtime: a kernel that does not compile, a
//! driver that refuses the launch, cuBLASLt returning an error. Burn's
//! backend traits return tensors, not `Result`s, so such a failure cannot
//! come back through the op that hit it.
//!
//! By default it panics with the kernel's name and the runtime's error.
//! Inside [`capture_launch_failures`] it is recorded instead: the op returns
//! outputs that hold nothing meaningful, the fused AdamW writes no
//! parameter while a failure is recorded ([`launch_failed`]), and the
//! caller gets the failures back to turn into an error.
//! `bastile_models::Trainer::step` runs each step this way: a failed launch
//! is an error naming the step and the kernel, and the step changes no
//! parameter.
//!
//! Burn runs a device's operations on a thread of its own, so a failure
//! cannot tell which caller queued the launch: it is recorded in every
//! capture active in the process (two trainers stepping at once both fail
//! their step), and panics when none is. Nothing fails silently. A step's
//! launches belong to its capture when they run before it ends: reading the
//! step's results runs everything queued before them. Errors the device
//! reports later, asynchronously, come back from Burn's
//! `Tensor::try_into_data`.
//!
//! Running out of device memory panics inside CubeCL's allocator, on the
//! device's thread, which carries on without the buffer; the caller sees
//! at most a later panic of its own. [`watch_out_of_memory`] turns that
//! into something a program can report: the failed allocation is recorded
//! as a failure of every running capture (so the fused AdamW writes
//! nothing) and its size kept for [`out_of_memory`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

use bastile_cubecl::KernelError;

/// A kernel launch that failed after its checks passed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchFailure {
    /// What was launched, e.g. `"RMSNorm forward"` or `"cuBLASLt matmul"`.
    pub kernel: String,
    /// The runtime's error.
    pub message: String,
}

impl fmt::Display for LaunchFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the {} launch failed: {}", self.kernel, self.message)
    }
}

impl std::error::Error for LaunchFailure {}

/// The captures running in the process: an id each, and the failures
/// recorded since it began.
struct Captures {
    next_id: u64,
    active: Vec<(u64, Vec<LaunchFailure>)>,
}

static CAPTURES: Mutex<Captures> = Mutex::new(Captures {
    next_id: 0,
    active: Vec::new(),
});

/// The captures; a panic while they were held (none of their code panics)
/// leaves them usable.
fn captures() -> MutexGuard<'static, Captures> {
    CAPTURES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f`, recording the kernel launches that fail while it runs
/// instead of panicking, and returns its value with those failures (in
/// launch order; empty when every launch succeeded). When any failure is
/// returned, whatever `f` computed after it is meaningless and must be
/// discarded. Captures may nest and run on several threads at once; each
/// receives every failure recorded while it runs.
pub fn capture_launch_failures<T>(f: impl FnOnce() -> T) -> (T, Vec<LaunchFailure>) {
    /// Ends the capture, also when `f` panics.
    struct End(u64);
    impl End {
        fn take(&self) -> Vec<LaunchFailure> {
            let mut c = captures();
            let at = c.active.iter().position(|(id, _)| *id == self.0);
            at.map(|i| c.active.remove(i).1).unwrap_or_default()
        }
    }
    impl Drop for End {
        fn drop(&mut self) {
            self.take();
        }
    }
    let end = {
        let mut c = captures();
        let id = c.next_id;
        c.next_id += 1;
        c.active.push((id, Vec::new()));
        End(id)
    };
    let value = f();
    let failures = end.take();
    (value, failures)
}

/// Whether a launch has failed while a [`capture_launch_failures`] runs
/// (`false` when none does). An op that writes state in place, like the
/// fused AdamW, checks it and writes nothing (in the whole process, for
/// the reason the module docs give).
pub fn launch_failed() -> bool {
    captures().active.iter().any(|(_, f)| !f.is_empty())
}

/// Handles a failed launch of `kernel`: recorded in every running capture,
/// a panic naming the kernel when none runs.
pub(crate) fn failed(kernel: &str, error: impl fmt::Display) {
    let failure = LaunchFailure {
        kernel: kernel.into(),
        message: error.to_string(),
    };
    if !record(&failure) {
        panic!("{failure} (after its checks passed)");
    }
}

/// Records `failure` in every running capture; whether one ran.
fn record(failure: &LaunchFailure) -> bool {
    let mut c = captures();
    for (_, failures) in &mut c.active {
        failures.push(failure.clone());
    }
    !c.active.is_empty()
}

/// What CubeCL's allocator says when the device has no buffer of the size
/// it asks for, before the size in bytes.
const ALLOCATION_FAILED: &str = "can't allocate buffer of size: ";

/// The bytes of the first device allocation that failed since
/// [`watch_out_of_memory`] (0: none).
static FAILED_ALLOCATION: AtomicU64 = AtomicU64::new(0);

/// The bytes a failed device allocation asked for, read from CubeCL's
/// panic message; `None` for any other message.
pub fn allocation_failure(message: &str) -> Option<u64> {
    let after = &message[message.find(ALLOCATION_FAILED)? + ALLOCATION_FAILED.len()..];
    let digits = after.split(|c: char| !c.is_ascii_digit()).next()?;
    digits.parse().ok()
}

/// From now on (in the whole process), notes a device allocation that
/// fails: its size is kept for [`out_of_memory`] and it is recorded in
/// every running capture as a failure of the `"device allocation"`, so
/// that the step it belongs to fails and writes no parameter. Its panic,
/// and every panic after it (the device threads' and the caller's, set off
/// by the missing buffer), print nothing: the program reports the one
/// error instead, and must not use the device again. Other panics print as
/// before. Installs a panic hook once; later calls do nothing.
pub fn watch_out_of_memory() {
    static WATCHING: Once = Once::new();
    WATCHING.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied());
            if let Some(bytes) = message.and_then(allocation_failure) {
                let first = FAILED_ALLOCATION
                    .compare_exchange(0, bytes.max(1), Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok();
                if first {
                    record(&LaunchFailure {
                        kernel: "device allocation".into(),
                        message: out_of_memory_message(bytes),
                    });
                }
            } else if FAILED_ALLOCATION.load(Ordering::SeqCst) == 0 {
                previous(info);
            }
        }));
    });
}

/// The bytes of the first device allocation that failed since
/// [`watch_out_of_memory`], if one did.
pub fn out_of_memory() -> Option<u64> {
    match FAILED_ALLOCATION.load(Ordering::SeqCst) {
        0 => None,
        bytes => Some(bytes),
    }
}

/// How a failed allocation of `bytes` is reported.
pub fn out_of_memory_message(bytes: u64) -> String {
    format!(
        "out of memory on the device: an allocation of {bytes} bytes ({:.2} GiB) failed",
        bytes as f64 / (1u64 << 30) as f64
    )
}

/// Launches `kernel` with `run`, whose problem was checked before; a failure
/// is [`failed`].
pub(crate) fn launch(kernel: &str, run: impl FnOnce() -> Result<(), KernelError>) {
    #[cfg(feature = "testing")]
    if testing::planted(kernel) {
        failed(kernel, KernelError::Launch("injected by a test".into()));
        return;
    }
    if let Err(e) = run() {
        failed(kernel, e);
    }
}

/// Planting launch failures, for tests of the code that handles them.
/// Planted failures are process-wide, like the captures: a test that plants
/// one must be the only one launching kernels in its process.
#[cfg(feature = "testing")]
pub mod testing {
    use std::sync::Mutex;

    static PLANTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

    /// The next launch of `kernel` fails (without running) as if the
    /// runtime had refused it.
    pub fn fail_next_launch(kernel: &str) {
        PLANTED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(kernel.into());
    }

    /// Whether a failure was planted for this launch of `kernel` (and takes
    /// it).
    pub(super) fn planted(kernel: &str) -> bool {
        let mut planted = PLANTED.lock().unwrap_or_else(|e| e.into_inner());
        let at = planted.iter().position(|k| k == kernel);
        at.map(|i| planted.remove(i)).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernels(failures: &[LaunchFailure]) -> Vec<&str> {
        failures.iter().map(|f| f.kernel.as_str()).collect()
    }

    /// One test: the captures are process-wide, so its parts must not
    /// overlap.
    #[test]
    fn captures_take_every_failure_and_end_on_panic_and_none_panics() {
        let ((), outer) = capture_launch_failures(|| {
            assert!(!launch_failed());
            failed("first", "a");
            assert!(launch_failed());
            let ((), inner) = capture_launch_failures(|| failed("inner", "b"));
            assert_eq!(kernels(&inner), ["inner"]);
            // Burn launches on a device thread, not the caller's.
            std::thread::spawn(|| failed("device thread", "c"))
                .join()
                .unwrap();
        });
        assert_eq!(kernels(&outer), ["first", "inner", "device thread"]);
        assert_eq!(outer[2].to_string(), "the device thread launch failed: c");
        assert!(!launch_failed());

        let caught = std::panic::catch_unwind(|| {
            capture_launch_failures(|| {
                failed("k", "x");
                panic!("inside");
            })
        });
        assert!(caught.is_err());
        assert!(!launch_failed());

        let panic = std::panic::catch_unwind(|| failed("RMSNorm forward", "boom")).unwrap_err();
        assert_eq!(
            panic.downcast_ref::<String>().map(String::as_str),
            Some("the RMSNorm forward launch failed: boom (after its checks passed)")
        );

        // A failed device allocation, as CubeCL's device thread panics with
        // it, is recorded in the running capture with its size.
        watch_out_of_memory();
        assert_eq!(out_of_memory(), None);
        let ((), failures) = capture_launch_failures(|| {
            std::thread::spawn(|| {
                panic!(
                    "called `Result::unwrap()` on an `Err` value: can't allocate buffer of \
                     size: 5313593344\nNo backtrace available"
                )
            })
            .join()
            .unwrap_err();
            assert!(launch_failed());
        });
        assert_eq!(out_of_memory(), Some(5_313_593_344));
        assert_eq!(
            failures,
            [LaunchFailure {
                kernel: "device allocation".into(),
                message: "out of memory on the device: an allocation of 5313593344 bytes \
                          (4.95 GiB) failed"
                    .into()
            }]
        );
        // Later panics print again (the hook stays).
        FAILED_ALLOCATION.store(0, Ordering::SeqCst);
    }

    #[test]
    fn allocation_failures_are_read_from_cubecl_messages() {
        let message = "called `Result::unwrap()` on an `Err` value: can't allocate buffer of \
                       size: 1024\nNo backtrace available";
        assert_eq!(allocation_failure(message), Some(1024));
        assert_eq!(
            allocation_failure("can't allocate buffer of size: 77"),
            Some(77)
        );
        assert_eq!(
            allocation_failure("called `Result::unwrap()` on an `Err` value: CallError"),
            None
        );
        assert_eq!(allocation_failure("can't allocate buffer of size: "), None);
    }
}
