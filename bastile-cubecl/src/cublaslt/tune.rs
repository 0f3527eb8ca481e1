//! Choosing among the heuristic's candidate algorithms by timing them.
//!
//! cuBLASLt's heuristic ranks algorithms by a model of the GPU; on short
//! products (a layer's projection, attention's batched score and value
//! products) its first choice is often not the fastest: on an H100 timing
//! the candidates gains 4–6% on the attention-shaped products and 6–13% on
//! a 4096×1024×2048 projection. On long ones it is the better judge: the
//! candidate that wins a few isolated runs of 8192³ loses ~10% in a stream
//! of calls. So the first call of each short problem runs every candidate
//! on the call's own buffers, on the call's stream, timed with CUDA events,
//! and the fastest is kept for the process; long problems keep the
//! heuristic's choice. Timed products write their whole output without
//! reading it (beta = 0; accumulating calls are never timed), so the extra
//! runs change nothing the caller sees; the real call follows them.
//!
//! `BASTILE_MATMUL_TUNE=off` keeps the heuristic's first choice (no host
//! wait on a new shape, for comparisons).

use std::sync::OnceLock;

use cudarc::cublaslt::sys::cublasLtMatmulAlgo_t;
use cudarc::driver::result::event;
use cudarc::driver::sys::{CUevent, CUevent_flags, CUstream};

use crate::KernelError;

/// Timed rounds; each runs every candidate once, in turn, so a change of
/// clock speed during the tuning weighs on all of them alike. A candidate's
/// time is its best round.
const ROUNDS: usize = 3;

/// How much faster than the heuristic's first choice another candidate must
/// be to replace it: less is within the rounds' noise.
const MARGIN: f32 = 0.97;

/// Products of at least this many FLOPs per call (2·m·n·k·batch; 8192³ is
/// 2⁴⁰, a 16384×4096×4096 MLP product 2³⁹) keep the heuristic's choice.
const LONG_FLOPS: f64 = (1u64 << 38) as f64;

/// Whether candidates are timed (the environment is read once: this runs on
/// every new problem).
pub fn enabled() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    *ENV.get_or_init(|| {
        !std::env::var("BASTILE_MATMUL_TUNE")
            .is_ok_and(|v| matches!(v.as_str(), "off" | "0" | "false"))
    })
}

/// Two events around one candidate's runs, destroyed on drop.
struct Span([CUevent; 2]);

impl Span {
    fn new() -> Result<Self, KernelError> {
        let create = || {
            event::create(CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| KernelError::Launch(format!("cuEventCreate: {e:?}")))
        };
        let start = create()?;
        match create() {
            Ok(end) => Ok(Self([start, end])),
            Err(e) => {
                // SAFETY: `start` was just created and is not recorded.
                unsafe { event::destroy(start) }.ok();
                Err(e)
            }
        }
    }

    fn record(&self, which: usize, stream: CUstream) -> Result<(), KernelError> {
        // SAFETY: a live event and a live stream of the current context.
        unsafe { event::record(self.0[which], stream) }
            .map_err(|e| KernelError::Launch(format!("cuEventRecord: {e:?}")))
    }

    fn millis(&self) -> Result<f32, KernelError> {
        // SAFETY: both events are live and were recorded on one stream.
        unsafe {
            event::synchronize(self.0[1])
                .and_then(|()| event::elapsed(self.0[0], self.0[1]))
                .map_err(|e| KernelError::Launch(format!("cuEventElapsedTime: {e:?}")))
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        for e in self.0 {
            // SAFETY: created by `Span::new`, destroyed once.
            unsafe { event::destroy(e) }.ok();
        }
    }
}

/// The fastest of `candidates` (best first, non-empty) for the call `run`
/// enqueues on `stream`, which does `flops` of work. A candidate whose
/// launch fails is passed over; if every one fails, the first failure is
/// returned.
pub fn fastest(
    stream: CUstream,
    flops: f64,
    candidates: &[cublasLtMatmulAlgo_t],
    mut run: impl FnMut(&cublasLtMatmulAlgo_t) -> Result<(), KernelError>,
) -> Result<cublasLtMatmulAlgo_t, KernelError> {
    if candidates.len() < 2 || flops >= LONG_FLOPS || !enabled() {
        return Ok(candidates[0]);
    }
    // An untimed round first: it brings the clocks up and drops the
    // candidates that cannot launch.
    let mut first_error = None;
    let usable: Vec<&cublasLtMatmulAlgo_t> = candidates
        .iter()
        .filter(|algo| match run(algo) {
            Ok(()) => true,
            Err(e) => {
                first_error.get_or_insert(e);
                false
            }
        })
        .collect();
    match (usable.len(), first_error) {
        (0, Some(e)) => return Err(e),
        (1, _) => return Ok(*usable[0]),
        _ => {}
    }
    let mut spans = Vec::with_capacity(ROUNDS * usable.len());
    for _ in 0..ROUNDS {
        for algo in &usable {
            let span = Span::new()?;
            span.record(0, stream)?;
            run(algo)?;
            span.record(1, stream)?;
            spans.push(span);
        }
    }
    let mut best = vec![f32::INFINITY; usable.len()];
    for (i, span) in spans.iter().enumerate() {
        let slot = &mut best[i % usable.len()];
        *slot = slot.min(span.millis()?);
    }
    let (winner, time) = best
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .expect("at least two usable candidates");
    // `usable[0]` is the heuristic's own first choice when it launched.
    Ok(if *time < best[0] * MARGIN {
        *usable[winner]
    } else {
        *usable[0]
    })
}
