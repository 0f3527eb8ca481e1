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
//! step's results runs everything queued before them. Running out of device
//! memory panics inside CubeCL's allocator, which no caller can catch.
//! Errors the device reports later, asynchronously, come back from Burn's
//! `Tensor::try_into_data`.

use std::fmt;
use std::sync::{Mutex, MutexGuard};

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
    let recorded = {
        let mut c = captures();
        for (_, failures) in &mut c.active {
            failures.push(failure.clone());
        }
        !c.active.is_empty()
    };
    if !recorded {
        panic!("{failure} (after its checks passed)");
    }
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
    }
}
