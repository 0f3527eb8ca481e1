//! Autotuning shared by every op: a memoized candidate list per device and
//! problem class, and one CubeCL tunable per candidate slot.
//!
//! Each op supplies its key (what the best configuration depends on), its
//! candidate configurations, its default first, and a launcher that runs
//! one of them. What runs depends on the [`TunePolicy`]: by default the
//! default configuration, compiled alone, so a fresh machine starts
//! training in seconds; with [`TunePolicy::Full`] CubeCL benchmarks the
//! candidates on first use of a key (compiling each) and keeps the winner
//! in its persistent cache.
//!
//! Each list puts first a configuration that was the fastest, or close to
//! it, on an sm_90 GPU (H100, H200) for the models' shapes; the same
//! configuration serves other architectures when it fits them (the lists
//! hold only configurations the device accepts).

use std::collections::HashMap;
use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cubecl::prelude::*;
use cubecl::tune::{AutotuneKey, LocalTuner, Tunable, TunableSet, TuneGroup};

use crate::KernelError;

/// How tuned ops pick their launch configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunePolicy {
    /// Each op's default configuration (the first of its candidates),
    /// nothing benchmarked: one kernel compiled per op and key.
    Defaults,
    /// The candidates are benchmarked on the first use of each key (every
    /// one compiled), and the fastest is kept in CubeCL's autotune cache:
    /// minutes on a fresh machine, for the last few percent of a step.
    Full,
}

/// The variable that sets the [`TunePolicy`]: `defaults` or `full`.
pub const TUNE_VAR: &str = "BASTILE_TUNE";

const POLICY_UNSET: u8 = 0;
const POLICY_DEFAULTS: u8 = 1;
const POLICY_FULL: u8 = 2;
static POLICY: AtomicU8 = AtomicU8::new(POLICY_UNSET);

/// The policy in force: the last [`set_tune_policy`], else `BASTILE_TUNE`
/// (`full` or `defaults`, read once), else [`TunePolicy::Defaults`].
pub fn tune_policy() -> TunePolicy {
    let code = match POLICY.load(Ordering::Relaxed) {
        POLICY_UNSET => {
            let text = std::env::var(TUNE_VAR).ok();
            let from_env = match policy_named(text.as_deref()) {
                Ok(TunePolicy::Full) => POLICY_FULL,
                Ok(TunePolicy::Defaults) => POLICY_DEFAULTS,
                Err(why) => {
                    eprintln!("bastile: {why}; each op's default configuration runs");
                    POLICY_DEFAULTS
                }
            };
            // A concurrent `set_tune_policy` wins over the environment.
            match POLICY.compare_exchange(
                POLICY_UNSET,
                from_env,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => from_env,
                Err(set) => set,
            }
        }
        code => code,
    };
    if code == POLICY_FULL {
        TunePolicy::Full
    } else {
        TunePolicy::Defaults
    }
}

/// The policy a value of `BASTILE_TUNE` names (unset or empty: the
/// defaults), or why it names none.
fn policy_named(text: Option<&str>) -> Result<TunePolicy, String> {
    match text.map(str::trim) {
        None | Some("") | Some("defaults") => Ok(TunePolicy::Defaults),
        Some("full") => Ok(TunePolicy::Full),
        Some(other) => Err(format!(
            "{TUNE_VAR}={other:?} is neither `defaults` nor `full`"
        )),
    }
}

/// Sets the policy for the rest of the process (over `BASTILE_TUNE`).
/// Keys tuned before keep their result.
pub fn set_tune_policy(policy: TunePolicy) {
    let code = match policy {
        TunePolicy::Defaults => POLICY_DEFAULTS,
        TunePolicy::Full => POLICY_FULL,
    };
    POLICY.store(code, Ordering::Relaxed);
}

/// How many candidates the autotuner benchmarks at most.
pub const MAX_TUNABLES: usize = 24;

/// How many of a problem's candidates a tuning run ([`TunePolicy::Full`])
/// benchmarks: all of them (up to [`MAX_TUNABLES`]) unless
/// `BASTILE_TUNE_CANDIDATES` holds a smaller positive count, in which case
/// the first ones (each op lists its default configuration first). Fewer
/// candidates tune sooner and may miss the fastest; every configuration
/// stays reachable through the `*_with` entry points. Read once per
/// process.
pub fn tuned_candidates_limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| match std::env::var("BASTILE_TUNE_CANDIDATES") {
        Err(_) => MAX_TUNABLES,
        Ok(text) => match text.trim().parse::<usize>() {
            Ok(n) if n >= 1 => n.min(MAX_TUNABLES),
            _ => {
                eprintln!(
                    "bastile: BASTILE_TUNE_CANDIDATES={text:?} is not a positive count; every candidate is tuned"
                );
                MAX_TUNABLES
            }
        },
    })
}

/// The autotune key of an op: its own key plus how many candidates are tuned
/// for the problem on this device (tunables past that count are skipped).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TuneKey<K> {
    pub op: K,
    pub candidates: usize,
}

impl<K: Display> Display for TuneKey<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} candidates)", self.op, self.candidates)
    }
}

/// What an op's own key must be to live in CubeCL's persistent cache.
pub trait OpKey:
    Clone
    + Debug
    + PartialEq
    + Eq
    + Hash
    + Display
    + serde::Serialize
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> OpKey for K where
    K: Clone
        + Debug
        + PartialEq
        + Eq
        + Hash
        + Display
        + serde::Serialize
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

impl<K: OpKey> AutotuneKey for TuneKey<K> {}

/// The tuner of one op (one static per op and direction).
pub type Tuner<K> = LocalTuner<TuneKey<K>, cubecl::CubeTuneId>;

/// Candidate lists per device and problem class. Building one checks every
/// configuration against the device, too slow to repeat on every launch.
pub struct CandidateCache<C, L> {
    lists: Mutex<Option<CandidateLists<C, L>>>,
}

type CandidateLists<C, L> = HashMap<(cubecl::CubeTuneId, C), Arc<Vec<L>>>;

impl<C: Clone + Eq + Hash, L> CandidateCache<C, L> {
    pub const fn new() -> Self {
        Self {
            lists: Mutex::new(None),
        }
    }

    /// The list for `class` on the device of `id`, built by `build` once.
    pub fn get(
        &self,
        id: &cubecl::CubeTuneId,
        class: C,
        build: impl FnOnce() -> Vec<L>,
    ) -> Arc<Vec<L>> {
        let mut lists = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        lists
            .get_or_insert_with(HashMap::new)
            .entry((id.clone(), class))
            .or_insert_with(|| Arc::new(build()))
            .clone()
    }
}

impl<C: Clone + Eq + Hash, L> Default for CandidateCache<C, L> {
    fn default() -> Self {
        Self::new()
    }
}

/// Runs one explicit configuration.
pub type Launcher<R, P, Buffers, L> =
    fn(&ComputeClient<R>, &P, &Buffers, &L) -> Result<(), KernelError>;

type Inputs<R, P, Buffers, L, K> = (ComputeClient<R>, P, Buffers, Arc<Vec<L>>, K);

/// The buffers a benchmark run of a candidate uses, made from the real ones.
/// Kernels that overwrite an input in place swap in scratch outputs here, so
/// tuning leaves the real inputs intact.
pub type BenchBuffers<R, P, Buffers> = fn(&ComputeClient<R>, &P, &Buffers) -> Buffers;

/// The [`BenchBuffers`] of kernels that write no input: the real buffers.
pub fn same_buffers<R: Runtime, P, Buffers: Clone>(
    _client: &ComputeClient<R>,
    _problem: &P,
    buffers: &Buffers,
) -> Buffers {
    buffers.clone()
}

/// Runs `launch` with the first of `candidates`, or under
/// [`TunePolicy::Full`] with the configuration `tuner` picked for `key` on
/// the device of `id`, tuning it on first use. The tunable set holds one
/// tunable per candidate slot; each resolves its slot against the
/// problem's list.
#[allow(clippy::too_many_arguments)]
pub fn run_tuned<R, K, P, Buffers, L>(
    tuner: &'static Tuner<K>,
    key: K,
    launch: Launcher<R, P, Buffers, L>,
    client: &ComputeClient<R>,
    id: &cubecl::CubeTuneId,
    problem: &P,
    buffers: &Buffers,
    candidates: Arc<Vec<L>>,
) -> Result<(), KernelError>
where
    R: Runtime,
    K: OpKey,
    P: Clone + Send + Sync + 'static,
    Buffers: Clone + Send + Sync + 'static,
    L: Send + Sync + 'static,
{
    run_tuned_with(
        tuner,
        key,
        launch,
        same_buffers,
        client,
        id,
        problem,
        buffers,
        candidates,
    )
}

/// [`run_tuned`] whose benchmark runs use the buffers `bench` makes.
#[allow(clippy::too_many_arguments)]
pub fn run_tuned_with<R, K, P, Buffers, L>(
    tuner: &'static Tuner<K>,
    key: K,
    launch: Launcher<R, P, Buffers, L>,
    bench: BenchBuffers<R, P, Buffers>,
    client: &ComputeClient<R>,
    id: &cubecl::CubeTuneId,
    problem: &P,
    buffers: &Buffers,
    candidates: Arc<Vec<L>>,
) -> Result<(), KernelError>
where
    R: Runtime,
    K: OpKey,
    P: Clone + Send + Sync + 'static,
    Buffers: Clone + Send + Sync + 'static,
    L: Send + Sync + 'static,
{
    let Some(default) = candidates.first() else {
        return Err(KernelError::Unsupported(format!(
            "no launch configuration fits {key} on this device"
        )));
    };
    if tune_policy() == TunePolicy::Defaults {
        return launch(client, problem, buffers, default);
    }
    let set = tuner.init(move || {
        let group = TuneGroup::<TuneKey<K>>::new("candidates", |_| 0);
        let mut set = TunableSet::<TuneKey<K>, Inputs<R, P, Buffers, L, K>, ()>::new(
            move |(_, _, _, c, k): &Inputs<R, P, Buffers, L, K>| TuneKey {
                op: k.clone(),
                candidates: c.len().min(tuned_candidates_limit()),
            },
            move |_: &TuneKey<K>, (client, p, b, c, k): &Inputs<R, P, Buffers, L, K>| {
                (
                    client.clone(),
                    p.clone(),
                    bench(client, p, b),
                    c.clone(),
                    k.clone(),
                )
            },
        );
        for i in 0..MAX_TUNABLES {
            let tunable = Tunable::new(
                &format!("candidate-{i}"),
                move |(client, p, b, c, _): Inputs<R, P, Buffers, L, K>| {
                    let config = c.get(i).ok_or("no such candidate for this problem")?;
                    launch(&client, &p, &b, config).map_err(|e| e.to_string())
                },
            );
            set = set.with(tunable.group(
                &group,
                move |key: &TuneKey<K>| {
                    if i < key.candidates { 0 } else { -1 }
                },
            ));
        }
        set
    });
    tuner.execute(
        id,
        client,
        set,
        (
            client.clone(),
            problem.clone(),
            buffers.clone(),
            candidates,
            key,
        ),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_names_a_policy_or_is_refused() {
        for (text, policy) in [
            (None, TunePolicy::Defaults),
            (Some(""), TunePolicy::Defaults),
            (Some("defaults"), TunePolicy::Defaults),
            (Some(" full\n"), TunePolicy::Full),
        ] {
            assert_eq!(policy_named(text), Ok(policy), "{text:?}");
        }
        let why = policy_named(Some("fast")).unwrap_err();
        assert!(why.contains("BASTILE_TUNE=\"fast\""), "{why}");
    }
}
