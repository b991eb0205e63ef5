//! The float primitive of `TensorParallel<B>`: this rank's part of a tensor, its [`Placement`]
//! over the group, and the global shape every op and every user sees.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape, TensorMetadata};

use super::placement::Placement;

/// A function the inner backend runs on whole tensors (the sums of a `Partial`'s sources).
pub(crate) type Recipe<B> = Arc<dyn Fn(&[FloatTensor<B>]) -> FloatTensor<B> + Send + Sync>;

/// A float tensor of `TensorParallel<B>`: this rank's part, where the rest lives, and the global
/// shape ([`TensorMetadata::shape`] is always the global shape, so a model's `dims()` and
/// `reshape` see the unsharded tensor).
pub struct TpTensor<B: Backend> {
    pub(crate) repr: Repr<B>,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    /// Under ZeRO stage 3: this tensor is a parameter's shard at rest, or a view of one by
    /// layout ops, so that its gather can be served by one started ahead (see `prefetch`).
    pub(crate) tag: Option<Arc<ParamTag<B>>>,
}

/// A layout op on a rank's part of a tensor (a swap of dimensions, a reshape to the part's
/// shape): it makes each rank's part of the view from its part of what it views, whichever the
/// rank.
pub(crate) type View<B> = Arc<dyn Fn(FloatTensor<B>) -> FloatTensor<B> + Send + Sync>;

/// Which parameter's shard at rest a tensor shows, and how (see [`TpTensor::tag`]).
pub(crate) struct ParamTag<B: Backend> {
    /// The parameter's id's number.
    pub(crate) param: u64,
    /// Which of the parameter's values: each value registered at rest gets a new one.
    pub(crate) serial: u64,
    /// The layout ops, in order, that make each rank's part of this tensor from its part of the
    /// parameter's shard.
    pub(crate) views: Vec<View<B>>,
}

impl<B: Backend> ParamTag<B> {
    /// The tag of a tensor made from one tagged `from` by the layout op `view` (on parts).
    pub(crate) fn viewed(
        from: &Option<Arc<Self>>,
        view: impl Fn(FloatTensor<B>) -> FloatTensor<B> + Send + Sync + 'static,
    ) -> Option<Arc<Self>> {
        from.as_ref().map(|t| {
            let mut views = t.views.clone();
            views.push(Arc::new(view));
            Arc::new(ParamTag {
                param: t.param,
                serial: t.serial,
                views,
            })
        })
    }
}

pub(crate) enum Repr<B: Backend> {
    /// `Replicate` (the whole tensor) or `Shard` (this rank's part).
    Local {
        tensor: FloatTensor<B>,
        placement: Placement,
    },
    /// The same value everywhere (`zeros`, `ones`, `full`): made on demand in whatever placement
    /// an op needs, so a sharded op never builds the whole of a constant (autodiff makes many).
    Fill { value: f64, device: B::Device },
    /// A pending sum over the group.
    Partial(Arc<PartialCell<B>>),
}

/// A `Partial` tensor's state, shared by its clones: once one of them is summed over the group,
/// all of them are.
///
/// Its value is the sum over the ranks of each rank's `local` term, plus `addend`, a whole tensor
/// every rank holds alike (a bias or a residual added to a pending sum: kept apart so that it is
/// counted once, and so that adding it costs no communication). A `Partial` made by linear ops
/// from others records them (`origin`): once they are summed it is computed from their sums, and
/// summing it may sum its one source instead when that is no larger (a residual stream summed
/// once serves the layer norm that reads it and the next residual add).
pub(crate) struct PartialCell<B: Backend> {
    state: Mutex<PartialState<B>>,
    numel: usize,
}

enum PartialState<B: Backend> {
    Pending {
        local: FloatTensor<B>,
        addend: Option<FloatTensor<B>>,
        origin: Option<Origin<B>>,
    },
    /// Summed: the whole tensor.
    Reduced(FloatTensor<B>),
}

/// What a derived `Partial` is a linear function of.
pub(crate) struct Origin<B: Backend> {
    pub(crate) sources: Vec<Arc<PartialCell<B>>>,
    pub(crate) recipe: Recipe<B>,
}

impl<B: Backend> PartialCell<B> {
    pub(crate) fn new(
        local: FloatTensor<B>,
        addend: Option<FloatTensor<B>>,
        origin: Option<Origin<B>>,
    ) -> Arc<Self> {
        let numel = local.shape().num_elements();
        Arc::new(PartialCell {
            state: Mutex::new(PartialState::Pending {
                local,
                addend,
                origin,
            }),
            numel,
        })
    }

    fn state(&self) -> MutexGuard<'_, PartialState<B>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Elements of the tensor.
    pub(crate) fn numel(&self) -> usize {
        self.numel
    }

    /// The summed tensor, if it is known without communicating: summed already, or derived
    /// from sources that all are (then it is derived now, and kept).
    pub(crate) fn known_sum(&self) -> Option<FloatTensor<B>> {
        let (sources, recipe) = match &*self.state() {
            PartialState::Reduced(t) => return Some(t.clone()),
            PartialState::Pending { origin: None, .. } => return None,
            PartialState::Pending {
                origin: Some(o), ..
            } => (o.sources.clone(), o.recipe.clone()),
        };
        let sums: Vec<FloatTensor<B>> = sources
            .iter()
            .map(|s| s.known_sum())
            .collect::<Option<_>>()?;
        let sum = recipe(&sums);
        *self.state() = PartialState::Reduced(sum.clone());
        Some(sum)
    }

    /// The pending cells with no origin this one's value waits on (itself, if it has none).
    pub(crate) fn pending_roots(self: &Arc<Self>, out: &mut Vec<Arc<PartialCell<B>>>) {
        let sources = match &*self.state() {
            PartialState::Reduced(_) => return,
            PartialState::Pending { origin: None, .. } => {
                if !out.iter().any(|c| Arc::ptr_eq(c, self)) {
                    out.push(self.clone());
                }
                return;
            }
            PartialState::Pending {
                origin: Some(o), ..
            } => o.sources.clone(),
        };
        for s in &sources {
            s.pending_roots(out);
        }
    }

    /// This rank's term and the addend (or, once summed, the sum itself with `true`).
    pub(crate) fn term(&self) -> (FloatTensor<B>, Option<FloatTensor<B>>, bool) {
        match &*self.state() {
            PartialState::Pending { local, addend, .. } => (local.clone(), addend.clone(), false),
            PartialState::Reduced(t) => (t.clone(), None, true),
        }
    }

    /// Records the sum, once communicated.
    pub(crate) fn set_sum(&self, sum: FloatTensor<B>) {
        *self.state() = PartialState::Reduced(sum);
    }
}

impl<B: Backend> TpTensor<B> {
    /// A whole tensor, the same on every rank.
    pub(crate) fn replicated(tensor: FloatTensor<B>) -> Self {
        Self::local(tensor, Placement::Replicate, None)
    }

    /// This rank's part under `placement`; `shape` is the global shape (taken from `tensor` when
    /// `None`: right for `Replicate` only).
    pub(crate) fn local(
        tensor: FloatTensor<B>,
        placement: Placement,
        shape: Option<Shape>,
    ) -> Self {
        let shape = shape.unwrap_or_else(|| tensor.shape());
        let dtype = tensor.dtype();
        TpTensor {
            repr: Repr::Local { tensor, placement },
            shape,
            dtype,
            tag: None,
        }
    }

    /// A pending sum whose term on this rank is `tensor` (of the global shape).
    pub(crate) fn partial(tensor: FloatTensor<B>) -> Self {
        Self::from_cell(PartialCell::new(tensor, None, None))
    }

    /// The `Partial` of `cell`.
    pub(crate) fn from_cell(cell: Arc<PartialCell<B>>) -> Self {
        let (local, _, _) = cell.term();
        let (shape, dtype) = (local.shape(), local.dtype());
        TpTensor {
            repr: Repr::Partial(cell),
            shape,
            dtype,
            tag: None,
        }
    }

    /// The constant `value` everywhere.
    pub(crate) fn fill(value: f64, shape: Shape, dtype: DType, device: B::Device) -> Self {
        TpTensor {
            repr: Repr::Fill { value, device },
            shape,
            dtype,
            tag: None,
        }
    }

    /// The same tensor, tagged `tag` (see [`TpTensor::tag`]).
    pub(crate) fn tagged(mut self, tag: Option<Arc<ParamTag<B>>>) -> Self {
        self.tag = tag;
        self
    }

    /// Where the tensor lives (a constant counts as replicated).
    pub fn placement(&self) -> Placement {
        match &self.repr {
            Repr::Local { placement, .. } => *placement,
            Repr::Fill { .. } => Placement::Replicate,
            Repr::Partial(_) => Placement::Partial,
        }
    }

    /// The device this rank's part is on.
    pub(crate) fn device(&self) -> B::Device {
        match &self.repr {
            Repr::Local { tensor, .. } => B::float_device(tensor),
            Repr::Fill { device, .. } => device.clone(),
            Repr::Partial(cell) => B::float_device(&cell.term().0),
        }
    }
}

impl<B: Backend> Clone for TpTensor<B> {
    fn clone(&self) -> Self {
        TpTensor {
            repr: match &self.repr {
                Repr::Local { tensor, placement } => Repr::Local {
                    tensor: tensor.clone(),
                    placement: *placement,
                },
                Repr::Fill { value, device } => Repr::Fill {
                    value: *value,
                    device: device.clone(),
                },
                Repr::Partial(cell) => Repr::Partial(cell.clone()),
            },
            shape: self.shape.clone(),
            dtype: self.dtype,
            tag: self.tag.clone(),
        }
    }
}

impl<B: Backend> fmt::Debug for TpTensor<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TpTensor")
            .field("placement", &self.placement())
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl<B: Backend> TensorMetadata for TpTensor<B> {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn shape(&self) -> Shape {
        self.shape.clone()
    }
}
