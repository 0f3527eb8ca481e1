//! Graphs of cuDNN backend descriptors, their plans and their execution.

use std::ffi::c_void;

use cudarc::cudnn::sys::{
    self as dnn, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Ty,
    cudnnBackendDescriptor_t, cudnnBackendDescriptorType_t as Kind, cudnnBackendHeurMode_t,
    cudnnDataType_t, cudnnHandle_t, cudnnPointwiseMode_t, cudnnReduceTensorOp_t,
};
use cudarc::driver::sys::CUstream;

use super::status;
use crate::KernelError;

/// A tensor's id in a graph: how operations and a call's buffers name it.
pub(crate) type Uid = i64;

/// One backend descriptor, destroyed with its owner.
struct Desc(cudnnBackendDescriptor_t);

// SAFETY: a descriptor is plain host memory of cuDNN's; the plans that own
// them are used under their device's lock.
unsafe impl Send for Desc {}

impl Drop for Desc {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: created by `cudnnBackendCreateDescriptor`, destroyed
            // once (a finalized descriptor moves on with a null left here).
            unsafe { dnn::cudnnBackendDestroyDescriptor(self.0) };
        }
    }
}

fn unsupported(what: impl std::fmt::Display) -> KernelError {
    KernelError::Unsupported(format!("cuDNN: {what}"))
}

impl Desc {
    fn new(kind: Kind) -> Result<Self, KernelError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` receives a new descriptor.
        status(unsafe { dnn::cudnnBackendCreateDescriptor(kind, &mut raw) })
            .map_err(|e| unsupported(format!("creating {kind:?}: {e}")))?;
        Ok(Self(raw))
    }

    /// Sets attribute `name` to `values`, of cuDNN type `ty` (which must
    /// be `V`'s C type).
    fn set<V: Copy>(&mut self, name: Attr, ty: Ty, values: &[V]) -> Result<&mut Self, KernelError> {
        // SAFETY: `values` holds `values.len()` elements of the C type `ty`
        // names (each call site pairs them); cuDNN copies them.
        let s = unsafe {
            dnn::cudnnBackendSetAttribute(
                self.0,
                name,
                ty,
                values.len() as i64,
                values.as_ptr().cast(),
            )
        };
        status(s).map_err(|e| unsupported(format!("{name:?}: {e}")))?;
        Ok(self)
    }

    fn descs(&mut self, name: Attr, descs: &[&Desc]) -> Result<&mut Self, KernelError> {
        let raw: Vec<cudnnBackendDescriptor_t> = descs.iter().map(|d| d.0).collect();
        self.set(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)
    }

    fn finalize(mut self) -> Result<Self, KernelError> {
        // SAFETY: a descriptor whose attributes were set above.
        status(unsafe { dnn::cudnnBackendFinalize(self.0) })
            .map_err(|e| unsupported(format!("finalizing: {e}")))?;
        Ok(std::mem::replace(&mut self, Desc(std::ptr::null_mut())))
    }

    fn get_i64(&self, name: Attr) -> Result<i64, KernelError> {
        let (mut value, mut count) = (0i64, 0i64);
        // SAFETY: one INT64 into `value`.
        let s = unsafe {
            dnn::cudnnBackendGetAttribute(
                self.0,
                name,
                Ty::CUDNN_TYPE_INT64,
                1,
                &mut count,
                (&mut value as *mut i64).cast(),
            )
        };
        status(s).map_err(|e| unsupported(format!("{name:?}: {e}")))?;
        Ok(value)
    }
}

/// How a graph tensor is stored.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Storage {
    /// A buffer a call names.
    Buffer,
    /// Computed and consumed inside the fused kernels.
    Virtual,
    /// A host scalar a call passes by value.
    Scalar,
}

/// A graph of operations under construction; [`Graph::plan`] builds it.
pub(crate) struct Graph {
    tensors: Vec<(Uid, Desc)>,
    ops: Vec<Desc>,
    /// The next id of a virtual tensor (the caller's ids stay below).
    next_virtual: Uid,
}

/// A graph tensor's dims and strides (in elements).
pub(crate) type Layout = ([i64; 4], [i64; 4]);

/// A by-value `[1, 1, 1, 1]` tensor's layout.
pub(crate) const SCALAR: Layout = ([1; 4], [1; 4]);

impl Graph {
    pub fn new() -> Self {
        Self {
            tensors: Vec::new(),
            ops: Vec::new(),
            next_virtual: 1 << 20,
        }
    }

    /// Declares tensor `uid` of `dtype` and `layout`.
    pub fn tensor(
        &mut self,
        uid: Uid,
        dtype: cudnnDataType_t,
        (dims, strides): Layout,
        storage: Storage,
    ) -> Result<Uid, KernelError> {
        let mut d = Desc::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(
            Attr::CUDNN_ATTR_TENSOR_DATA_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[dtype],
        )?
        .set(
            Attr::CUDNN_ATTR_TENSOR_DIMENSIONS,
            Ty::CUDNN_TYPE_INT64,
            &dims,
        )?
        .set(
            Attr::CUDNN_ATTR_TENSOR_STRIDES,
            Ty::CUDNN_TYPE_INT64,
            &strides,
        )?
        .set(
            Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID,
            Ty::CUDNN_TYPE_INT64,
            &[uid],
        )?
        // Buffers are checked for 16-byte alignment before a graph is
        // built for them.
        .set(
            Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
            Ty::CUDNN_TYPE_INT64,
            &[16i64],
        )?;
        match storage {
            Storage::Virtual => {
                d.set(
                    Attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
                    Ty::CUDNN_TYPE_BOOLEAN,
                    &[true],
                )?;
            }
            Storage::Scalar => {
                d.set(
                    Attr::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                    Ty::CUDNN_TYPE_BOOLEAN,
                    &[true],
                )?;
            }
            Storage::Buffer => {}
        }
        self.tensors.push((uid, d.finalize()?));
        Ok(uid)
    }

    /// A new virtual tensor.
    pub fn virt(&mut self, dtype: cudnnDataType_t, layout: Layout) -> Result<Uid, KernelError> {
        let uid = self.next_virtual;
        self.next_virtual += 1;
        self.tensor(uid, dtype, layout, Storage::Virtual)
    }

    fn get(&self, uid: Uid) -> &Desc {
        &self
            .tensors
            .iter()
            .find(|(u, _)| *u == uid)
            .expect("graph tensors are declared before their operations")
            .1
    }

    /// `y = mode(x, b, t)` element-wise, broadcasting `b` and `t`
    /// (`GEN_INDEX`: the index of `x`'s elements along `axis`).
    #[allow(clippy::too_many_arguments)]
    pub fn pointwise(
        &mut self,
        mode: cudnnPointwiseMode_t,
        x: Uid,
        b: Option<Uid>,
        t: Option<Uid>,
        y: Uid,
        axis: Option<i64>,
        precision: cudnnDataType_t,
    ) -> Result<(), KernelError> {
        let mut pw = Desc::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.set(
            Attr::CUDNN_ATTR_POINTWISE_MODE,
            Ty::CUDNN_TYPE_POINTWISE_MODE,
            &[mode],
        )?
        .set(
            Attr::CUDNN_ATTR_POINTWISE_MATH_PREC,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[precision],
        )?;
        if let Some(axis) = axis {
            pw.set(
                Attr::CUDNN_ATTR_POINTWISE_AXIS,
                Ty::CUDNN_TYPE_INT64,
                &[axis],
            )?;
        }
        let pw = pw.finalize()?;
        let mut op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?
            .descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[self.get(x)])?
            .descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[self.get(y)])?;
        if let Some(b) = b {
            op.descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[self.get(b)])?;
        }
        if let Some(t) = t {
            op.descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[self.get(t)])?;
        }
        op.set(
            Attr::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1,
            Ty::CUDNN_TYPE_FLOAT,
            &[1.0f32],
        )?
        .set(
            Attr::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2,
            Ty::CUDNN_TYPE_FLOAT,
            &[1.0f32],
        )?;
        self.ops.push(op.finalize()?);
        Ok(())
    }

    /// `c = a · b` over the last two dims (batched over the first two,
    /// `b`'s heads broadcast over `a`'s), accumulated in f32.
    pub fn matmul(&mut self, a: Uid, b: Uid, c: Uid) -> Result<(), KernelError> {
        let mut mm = Desc::new(Kind::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        mm.set(
            Attr::CUDNN_ATTR_MATMUL_COMP_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[cudnnDataType_t::CUDNN_DATA_FLOAT],
        )?;
        let mm = mm.finalize()?;
        let mut op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[self.get(a)])?
            .descs(Attr::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[self.get(b)])?
            .descs(Attr::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[self.get(c)])?
            .descs(Attr::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&mm])?;
        self.ops.push(op.finalize()?);
        Ok(())
    }

    /// `y` = `x` reduced with `op` over the dims where `y` has extent 1.
    pub fn reduce(&mut self, op: cudnnReduceTensorOp_t, x: Uid, y: Uid) -> Result<(), KernelError> {
        let mut r = Desc::new(Kind::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        r.set(
            Attr::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[cudnnDataType_t::CUDNN_DATA_FLOAT],
        )?
        .set(
            Attr::CUDNN_ATTR_REDUCTION_OPERATOR,
            Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            &[op],
        )?;
        let r = r.finalize()?;
        let mut o = Desc::new(Kind::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        o.descs(Attr::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&r])?
            .descs(Attr::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[self.get(x)])?
            .descs(Attr::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[self.get(y)])?;
        self.ops.push(o.finalize()?);
        Ok(())
    }

    /// `y` = `x` seen with `y`'s dims and strides (a transpose here).
    pub fn reshape(&mut self, x: Uid, y: Uid) -> Result<(), KernelError> {
        let mut o = Desc::new(Kind::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        o.descs(Attr::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[self.get(x)])?
            .descs(Attr::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[self.get(y)])?;
        self.ops.push(o.finalize()?);
        Ok(())
    }

    /// The graph's execution plan: the first of the heuristic's engines
    /// (mode A, cuDNN's choice for fused graphs) that builds it.
    pub fn plan(self, handle: cudnnHandle_t) -> Result<Plan, KernelError> {
        let ops: Vec<&Desc> = self.ops.iter().collect();
        let mut graph = Desc::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph
            .descs(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?
            .set(
                Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
                Ty::CUDNN_TYPE_HANDLE,
                &[handle],
            )?;
        let graph = graph.finalize()?;
        let mut heur = Desc::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heur.descs(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&graph])?
            .set(
                Attr::CUDNN_ATTR_ENGINEHEUR_MODE,
                Ty::CUDNN_TYPE_HEUR_MODE,
                &[cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A],
            )?;
        let heur = heur.finalize()?;
        let configs = engine_configs(&heur)?;
        let mut refused = Vec::new();
        for config in &configs {
            match build_plan(handle, config) {
                Ok((plan, workspace)) => {
                    return Ok(Plan {
                        plan,
                        workspace,
                        _graph: (self, graph),
                    });
                }
                Err(e) => refused.push(e.to_string()),
            }
        }
        Err(unsupported(format!(
            "no engine of {} builds the graph ({})",
            configs.len(),
            refused.join("; ")
        )))
    }
}

/// The heuristic's engine configurations, best first.
fn engine_configs(heur: &Desc) -> Result<Vec<Desc>, KernelError> {
    let get = |requested: i64, out: *mut cudnnBackendDescriptor_t| {
        let mut count = 0i64;
        // SAFETY: `out` holds `requested` created descriptors (or is null
        // with none requested, which asks for the count).
        let s = unsafe {
            dnn::cudnnBackendGetAttribute(
                heur.0,
                Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                requested,
                &mut count,
                out.cast::<c_void>(),
            )
        };
        status(s)
            .map(|_| count)
            .map_err(|e| unsupported(format!("engine heuristic: {e}")))
    };
    let available = get(0, std::ptr::null_mut())?;
    let configs = (0..available)
        .map(|_| Desc::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<Result<Vec<_>, _>>()?;
    let mut raw: Vec<cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
    let got = get(available, raw.as_mut_ptr())?;
    Ok(configs.into_iter().take(got.max(0) as usize).collect())
}

fn build_plan(handle: cudnnHandle_t, config: &Desc) -> Result<(Desc, usize), KernelError> {
    let mut plan = Desc::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(
        Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
        Ty::CUDNN_TYPE_HANDLE,
        &[handle],
    )?
    .descs(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[config])?;
    let plan = plan.finalize()?;
    let workspace = plan.get_i64(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
    Ok((plan, workspace.max(0) as usize))
}

/// A host value for a by-value tensor of a call.
pub(crate) struct Scalar(pub Uid, pub f32);

/// A built graph, ready to run on buffers.
pub(crate) struct Plan {
    plan: Desc,
    /// Device bytes of scratch a call needs.
    pub workspace: usize,
    /// The tensors, operations and graph the plan was built from.
    _graph: (Graph, Desc),
}

impl Plan {
    /// Enqueues the plan on `stream`: `buffers` give each buffer tensor's
    /// device address, `scalars` each by-value tensor's value.
    ///
    /// # Safety
    /// The addresses are live device buffers of the current context, each
    /// holding what the graph declared for its id, and `workspace` holds
    /// [`Plan::workspace`] bytes; `stream` orders the call after the
    /// writes of its inputs and before any reuse of its buffers.
    pub unsafe fn execute(
        &self,
        handle: cudnnHandle_t,
        stream: CUstream,
        buffers: &[(Uid, u64)],
        scalars: &[Scalar],
        workspace: u64,
    ) -> Result<(), KernelError> {
        let launch = |what: &str, e: String| KernelError::Launch(format!("cuDNN {what}: {e}"));
        let mut uids: Vec<Uid> = buffers.iter().map(|b| b.0).collect();
        let mut pointers: Vec<*mut c_void> = buffers.iter().map(|b| b.1 as *mut c_void).collect();
        uids.extend(scalars.iter().map(|s| s.0));
        pointers.extend(scalars.iter().map(|s| &s.1 as *const f32 as *mut c_void));
        let mut pack = Desc::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            Ty::CUDNN_TYPE_INT64,
            &uids,
        )?
        .set(
            Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            Ty::CUDNN_TYPE_VOID_PTR,
            &pointers,
        )?
        .set(
            Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            Ty::CUDNN_TYPE_VOID_PTR,
            &[workspace as *mut c_void],
        )?;
        let pack = pack.finalize()?;
        // SAFETY: a live handle and stream of the current context.
        status(unsafe { dnn::cudnnSetStream(handle, stream as _) })
            .map_err(|e| launch("cudnnSetStream", e))?;
        // SAFETY: the caller's contract; the by-value scalars live until
        // the call returns (cuDNN reads them while enqueuing).
        status(unsafe { dnn::cudnnBackendExecute(handle, self.plan.0, pack.0) })
            .map_err(|e| launch("execute", e))
    }
}
