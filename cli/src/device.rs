//! The backend a command runs on: with the fused kernels,
//! `Autodiff<Bastile<CudaDirect>>` for a dense model on one GPU or several,
//! `Autodiff<Bastile<Cuda>>` for a model with experts (or over
//! wgpu/Vulkan); Burn's own backend without Bastile for the baseline; or
//! Burn's CPU backend where no GPU is present.

#[cfg(any(feature = "cuda", feature = "wgpu"))]
use bastile::Bastile;
use bastile::BastileBackend;
use bastile_models::{CausalLm, Collective, MicroBatch};
use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use clap::ValueEnum;

use crate::CliError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// CUDA when a GPU and its driver are present, else the CPU.
    Auto,
    Cuda,
    /// Any Vulkan device through wgpu (also Mesa's software driver).
    Vulkan,
    /// Burn's CPU backend (Bastile's kernels need CUDA or Vulkan).
    Cpu,
}

/// What a task learns of the backend it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunInfo {
    pub device: DeviceKind,
    /// Whether Bastile's fused kernels are in use.
    pub bastile: bool,
    /// On CUDA, the Burn backend the model runs on, which the run's
    /// description names.
    pub cuda_backend: Option<CudaBackend>,
    /// On CUDA with Bastile's kernels, the version of the cuDNN whose
    /// fused attention runs the models' attention (`None`: not loaded).
    pub cudnn: Option<usize>,
}

/// A cuDNN version number (`major·10000 + minor·100 + patch`) as people
/// write it.
pub fn cudnn_name(version: usize) -> String {
    format!(
        "cuDNN {}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    )
}

impl RunInfo {
    /// Sequence lengths are padded up to a multiple of this: on a GPU
    /// every new length means new kernels to compile and matmuls to tune,
    /// so a few length buckets are much faster than exact lengths; on the
    /// CPU the padding would only cost compute.
    pub fn pad_multiple(&self) -> usize {
        if self.device == DeviceKind::Cpu {
            1
        } else {
            64
        }
    }

    /// A run on CUDA over `backend`, with Bastile's kernels or not (then
    /// also the cuDNN whose attention they use, if it is loaded).
    #[cfg(feature = "cuda")]
    fn cuda(bastile: bool, backend: CudaBackend) -> Self {
        Self {
            device: DeviceKind::Cuda,
            bastile,
            cuda_backend: Some(backend),
            cudnn: bastile.then(bastile::cudnn_version).flatten(),
        }
    }

    pub fn describe(&self) -> String {
        let device = match self.device {
            DeviceKind::Cuda => "CUDA",
            DeviceKind::Vulkan => "Vulkan (wgpu)",
            _ => "CPU",
        };
        let ops = if self.bastile {
            "Bastile's fused kernels"
        } else {
            "Burn's own ops"
        };
        let attention = match self.cudnn {
            Some(v) => format!(", {}'s fused attention", cudnn_name(v)),
            None => String::new(),
        };
        match self.cuda_backend {
            Some(backend) => format!("{device} ({}), {ops}{attention}", backend.type_name()),
            None => format!("{device}, {ops}{attention}"),
        }
    }
}

/// The Burn backend a model trains on over CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaBackend {
    /// `bastile::CudaDirect`, Burn's `CubeBackend` without the fusion
    /// stream: Bastile's kernels fuse what the stream would, and a dense
    /// model's step queues faster without its per-op bookkeeping, on one
    /// GPU (`benches/results/direct-cuda-h200/`) and data-parallel
    /// (`benches/results/sweep-h200/`: 2 × H200, 85.5-86.2% scaling
    /// efficiency against 83.0-84.8%).
    Direct,
    /// `burn::backend::Cuda`, Burn's fusion stream over `CubeBackend`: a
    /// mixture of experts' step measured faster with it, and Burn's own ops
    /// (the baseline) run on it.
    Fusion,
}

impl CudaBackend {
    /// The backend for Bastile's kernels, given whether the models route
    /// their tokens to experts ([`routes_experts`]).
    pub fn for_bastile(routes_experts: bool) -> Self {
        if routes_experts {
            CudaBackend::Fusion
        } else {
            CudaBackend::Direct
        }
    }

    /// The short name a benchmark row carries.
    pub fn name(self) -> &'static str {
        match self {
            CudaBackend::Direct => "CudaDirect",
            CudaBackend::Fusion => "Cuda",
        }
    }

    /// The Rust type, as a run's description names it.
    pub fn type_name(self) -> &'static str {
        match self {
            CudaBackend::Direct => "bastile::CudaDirect",
            CudaBackend::Fusion => "burn::backend::Cuda",
        }
    }
}

/// Work generic over the training backend.
pub trait Task: Sized {
    type Output;

    /// The models the task runs (preset names or directories): on CUDA
    /// they decide whether it runs over Burn's fusion stream (see
    /// [`routes_experts`]).
    fn models(&self) -> Vec<String>;

    fn run<B>(self, device: B::Device, info: RunInfo) -> Result<Self::Output, CliError>
    where
        B: AutodiffBackend + BastileBackend,
        B::InnerBackend: BastileBackend;

    /// [`Task::run`] data-parallel over `devices` (the first is the one
    /// `run` would get), through `collective`; a task that runs on one
    /// device says so.
    fn run_data_parallel<B>(
        self,
        devices: Vec<B::Device>,
        collective: Collective<B::InnerBackend>,
        info: RunInfo,
    ) -> Result<Self::Output, CliError>
    where
        B: AutodiffBackend + BastileBackend,
        B::InnerBackend: BastileBackend,
        CausalLm<B>: Send + 'static,
        MicroBatch<B>: Send,
    {
        let _ = (devices, collective, info);
        Err(CliError::Usage("this command runs on one device".into()))
    }
}

/// Runs `task` on the backend `kind` and `bastile` select.
pub fn dispatch<T: Task>(kind: DeviceKind, bastile: bool, task: T) -> Result<T::Output, CliError> {
    let kind = match kind {
        DeviceKind::Auto if cuda_present() => DeviceKind::Cuda,
        DeviceKind::Auto => DeviceKind::Cpu,
        k => k,
    };
    let info = RunInfo {
        device: kind,
        bastile: bastile && kind != DeviceKind::Cpu,
        cuda_backend: None,
        cudnn: None,
    };
    if bastile && kind == DeviceKind::Cpu {
        eprintln!(
            "note: Bastile's fused kernels run on CUDA or Vulkan (--device cuda|vulkan); \
             on the CPU the model trains with Burn's own ops"
        );
    }
    match (kind, info.bastile) {
        (DeviceKind::Cuda, b) => cuda(b, task),
        (DeviceKind::Vulkan, b) => vulkan(b, task, info),
        _ => task.run::<Autodiff<NdArray>>(Default::default(), info),
    }
}

/// Runs `task` data-parallel on the first `devices` CUDA GPUs (NCCL sums
/// the gradients), or as [`dispatch`] does for one device.
pub fn dispatch_data_parallel<T: Task>(
    kind: DeviceKind,
    bastile: bool,
    devices: usize,
    task: T,
) -> Result<T::Output, CliError> {
    if devices <= 1 {
        return dispatch(kind, bastile, task);
    }
    match kind {
        DeviceKind::Cuda | DeviceKind::Auto => cuda_data_parallel(bastile, devices, task),
        _ => Err(CliError::Usage(format!(
            "--devices {devices} trains on several CUDA GPUs (--device cuda); --device {} runs \
             on one",
            kind.to_possible_value()
                .map_or(String::new(), |v| v.get_name().to_string())
        ))),
    }
}

#[cfg(feature = "distributed")]
fn cuda_data_parallel<T: Task>(
    bastile: bool,
    count: usize,
    task: T,
) -> Result<T::Output, CliError> {
    use burn::backend::Cuda;
    use burn::tensor::backend::{Backend, Device, DeviceId};
    if !cuda_present() {
        return Err(CliError::Usage(
            "--devices: no CUDA GPU or driver found on this machine".into(),
        ));
    }
    let present = <Cuda as Backend>::device_count(0);
    if count > present {
        return Err(CliError::Usage(format!(
            "--devices {count}: this machine has {present} CUDA GPU{}",
            if present == 1 { "" } else { "s" }
        )));
    }
    let devices: Vec<<Cuda as burn::tensor::backend::BackendTypes>::Device> = (0..count)
        .map(|k| Device::from_id(DeviceId::new(0, k as u16)))
        .collect();
    let backend = cuda_backend(bastile, &task);
    let info = RunInfo::cuda(bastile, backend);
    match (bastile, backend) {
        (true, CudaBackend::Direct) => {
            // Operations launch when called: the gradients are summed
            // while the backward pass runs.
            let collective = Collective::nccl(&devices)?.during_backward();
            task.run_data_parallel::<Autodiff<Bastile<bastile::CudaDirect>>>(
                devices, collective, info,
            )
        }
        (true, CudaBackend::Fusion) => {
            let collective = Collective::nccl(&devices)?;
            task.run_data_parallel::<Autodiff<Bastile<Cuda>>>(devices, collective, info)
        }
        (false, _) => {
            let collective = Collective::nccl(&devices)?;
            task.run_data_parallel::<Autodiff<Cuda>>(devices, collective, info)
        }
    }
}

#[cfg(not(feature = "distributed"))]
fn cuda_data_parallel<T: Task>(_: bool, count: usize, _: T) -> Result<T::Output, CliError> {
    Err(CliError::Usage(format!(
        "--devices {count}: this `bastile` was built without data-parallel training (feature \
         `distributed`)"
    )))
}

#[cfg(feature = "cuda")]
fn cuda<T: Task>(bastile: bool, task: T) -> Result<T::Output, CliError> {
    use burn::backend::Cuda;
    if !cuda_present() {
        return Err(CliError::Usage(
            "--device cuda: no CUDA GPU or driver found on this machine".into(),
        ));
    }
    let backend = cuda_backend(bastile, &task);
    let info = RunInfo::cuda(bastile, backend);
    match (bastile, backend) {
        (true, CudaBackend::Direct) => {
            task.run::<Autodiff<Bastile<bastile::CudaDirect>>>(Default::default(), info)
        }
        (true, CudaBackend::Fusion) => {
            task.run::<Autodiff<Bastile<Cuda>>>(Default::default(), info)
        }
        (false, _) => task.run::<Autodiff<Cuda>>(Default::default(), info),
    }
}

/// The backend `task` runs on over CUDA: Bastile's kernels on the one its
/// models take ([`CudaBackend::for_bastile`]), Burn's own ops on the fusion
/// stream (their configs are then not read).
#[cfg(feature = "cuda")]
fn cuda_backend<T: Task>(bastile: bool, task: &T) -> CudaBackend {
    if bastile {
        CudaBackend::for_bastile(routes_experts(task))
    } else {
        CudaBackend::Fusion
    }
}

/// Whether any of the task's models routes its tokens to experts (see
/// [`model_routes_experts`]).
pub fn routes_experts<T: Task>(task: &T) -> bool {
    task.models()
        .iter()
        .any(|model| model_routes_experts(model))
}

/// Whether `model` (a preset name or a directory) routes its tokens to
/// experts, as its resolved config says (GPT-OSS): on CUDA it decides the
/// backend ([`CudaBackend::for_bastile`]). A model whose config cannot be
/// read or resolved counts as dense: the task says why when it loads the
/// model.
pub fn model_routes_experts(model: &str) -> bool {
    crate::source::ModelSource::parse(model)
        .and_then(|source| Ok(source.config()?.resolve()?))
        .is_ok_and(|config| config.moe.is_some())
}

#[cfg(not(feature = "cuda"))]
fn cuda<T: Task>(_: bool, _: T) -> Result<T::Output, CliError> {
    Err(CliError::Usage(
        "this `bastile` was built without CUDA support (feature `cuda`)".into(),
    ))
}

#[cfg(feature = "wgpu")]
fn vulkan<T: Task>(bastile: bool, task: T, info: RunInfo) -> Result<T::Output, CliError> {
    use burn::backend::Wgpu;
    if bastile {
        task.run::<Autodiff<Bastile<Wgpu>>>(Default::default(), info)
    } else {
        task.run::<Autodiff<Wgpu>>(Default::default(), info)
    }
}

#[cfg(not(feature = "wgpu"))]
fn vulkan<T: Task>(_: bool, _: T, _: RunInfo) -> Result<T::Output, CliError> {
    Err(CliError::Usage(
        "this `bastile` was built without Vulkan support (feature `wgpu`)".into(),
    ))
}

/// Whether a CUDA device answers: CubeCL's client creation panics without
/// a driver, so the probe runs once, its panic caught and kept quiet.
#[cfg(feature = "cuda")]
pub fn cuda_present() -> bool {
    use std::sync::OnceLock;
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let ok = std::panic::catch_unwind(|| {
            let device = Default::default();
            burn::tensor::Tensor::<burn::backend::Cuda, 1>::ones([1], &device)
                .into_data()
                .to_vec::<f32>()
                .is_ok()
        })
        .unwrap_or(false);
        std::panic::set_hook(hook);
        ok
    })
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_present() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Runs(Vec<&'static str>);

    impl Task for Runs {
        type Output = ();

        fn models(&self) -> Vec<String> {
            self.0.iter().map(|m| m.to_string()).collect()
        }

        fn run<B>(self, _: B::Device, _: RunInfo) -> Result<(), CliError>
        where
            B: AutodiffBackend + BastileBackend,
            B::InnerBackend: BastileBackend,
        {
            Ok(())
        }
    }

    #[test]
    fn a_run_names_its_device_its_ops_and_on_cuda_its_backend() {
        let cuda = RunInfo {
            device: DeviceKind::Cuda,
            bastile: true,
            cuda_backend: Some(CudaBackend::Direct),
            cudnn: None,
        };
        assert_eq!(
            cuda.describe(),
            "CUDA (bastile::CudaDirect), Bastile's fused kernels"
        );
        let with_cudnn = RunInfo {
            cudnn: Some(91400),
            ..cuda
        };
        assert_eq!(
            with_cudnn.describe(),
            "CUDA (bastile::CudaDirect), Bastile's fused kernels, cuDNN 9.14.0's fused attention"
        );
        let cpu = RunInfo {
            device: DeviceKind::Cpu,
            bastile: false,
            cuda_backend: None,
            cudnn: None,
        };
        assert_eq!(cpu.describe(), "CPU, Burn's own ops");
    }

    #[test]
    fn only_models_with_experts_route_experts() {
        assert!(!routes_experts(&Runs(vec!["qwen3-0.6b", "llama-3.2-1b"])));
        assert!(routes_experts(&Runs(vec!["gpt-oss-20b-4l"])));
        // Any one model with experts decides for the task.
        assert!(routes_experts(&Runs(vec!["bastile-tiny", "gpt-oss-20b"])));
        // An unknown model is left to the task, which names it.
        assert!(!routes_experts(&Runs(vec!["no-such-model"])));
        assert!(routes_experts(&Runs(vec!["no-such-model", "GPT-OSS-20B"])));
    }
}
