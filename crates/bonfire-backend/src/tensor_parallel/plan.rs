//! Plans: which parameters of an ordinary Burn model are split over the tensor-parallel group,
//! by parameter path, and applying one to a model.

use std::collections::BTreeMap;
use std::fmt;

use bonfire_collectives::{CollectiveError, Communicator};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Tensor, TensorPrimitive};
use thiserror::Error;

use super::backend::TensorParallelBackend;
use super::context;
use super::placement::{Placement, divisible, local_shape};
use super::redistribute::{Why, shard_of, whole};
use super::tensor::TpTensor;
use crate::FailurePolicy;

/// How a rule splits the parameters of the modules it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// A `nn::Linear` split by output features (Megatron's column-parallel layer): weight
    /// `[d_in, d_out]` split on `d_out`, bias split alike. Its output is split by features; a
    /// following `row` layer takes it as it is. `parts > 1` splits each of `parts` equal groups of
    /// output features on its own (a fused query/key/value projection: `parts = 3`).
    Column {
        /// Equal groups of output features, each split over the ranks.
        parts: usize,
    },
    /// A `nn::Linear` split by input features (row-parallel): weight split on `d_in`, bias whole.
    /// Its output is a partial sum, summed over the group (one all-reduce) when the bias is added
    /// or the next op needs it whole.
    Row,
    /// A `nn::Embedding` (or any `[vocab, d]` table) split by rows: each rank looks up the rows
    /// it holds (one all-reduce of the output), and a head tied to it produces logits split by
    /// vocabulary, which cross-entropy consumes without gathering them.
    Vocab,
    /// Whole on every rank (the default for parameters no rule matches; a rule makes it
    /// explicit).
    Replicate,
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Split::Column { parts: 1 } => write!(f, "column"),
            Split::Column { parts } => write!(f, "column ({parts} parts)"),
            Split::Row => write!(f, "row"),
            Split::Vocab => write!(f, "vocab"),
            Split::Replicate => write!(f, "replicate"),
        }
    }
}

/// Which parameters to split, by module path with `*` wildcards (one path segment each):
/// `"blocks.*.mlp.fc1"` matches the parameters of `blocks.0.mlp.fc1`, `blocks.1.mlp.fc1`, ...
/// (the paths are the model's field names and `Vec` indices, as Burn's records name them).
///
/// ```
/// use bonfire_backend::TpPlan;
///
/// let plan = TpPlan::new()
///     .column("layers.*.mha.query").column("layers.*.mha.key").column("layers.*.mha.value")
///     .row("layers.*.mha.output")
///     .column("layers.*.pwff.linear_inner").row("layers.*.pwff.linear_outer");
/// assert_eq!(plan.rules().len(), 6);
/// ```
#[derive(Clone, Debug, Default)]
pub struct TpPlan {
    rules: Vec<(String, Split)>,
}

impl TpPlan {
    /// An empty plan (every parameter whole).
    pub fn new() -> Self {
        Self::default()
    }

    /// Splits the linear layers at `pattern` by output features ([`Split::Column`]).
    pub fn column(self, pattern: &str) -> Self {
        self.rule(pattern, Split::Column { parts: 1 })
    }

    /// Splits the linear layers at `pattern` by output features in `parts` equal groups, each
    /// split on its own ([`Split::Column`]; a fused q/k/v projection has 3).
    pub fn column_parts(self, pattern: &str, parts: usize) -> Self {
        self.rule(pattern, Split::Column { parts })
    }

    /// Splits the linear layers at `pattern` by input features ([`Split::Row`]).
    pub fn row(self, pattern: &str) -> Self {
        self.rule(pattern, Split::Row)
    }

    /// Splits the embedding tables at `pattern` by rows ([`Split::Vocab`]).
    pub fn vocab(self, pattern: &str) -> Self {
        self.rule(pattern, Split::Vocab)
    }

    /// Keeps the parameters at `pattern` whole ([`Split::Replicate`]).
    pub fn replicate(self, pattern: &str) -> Self {
        self.rule(pattern, Split::Replicate)
    }

    /// Adds a rule.
    pub fn rule(mut self, pattern: &str, split: Split) -> Self {
        self.rules.push((pattern.to_string(), split));
        self
    }

    /// The rules, in order.
    pub fn rules(&self) -> &[(String, Split)] {
        &self.rules
    }

    /// The rules matching module path `module` (a parameter's path without its last segment),
    /// with their indices.
    fn matching(&self, module: &str) -> Vec<usize> {
        let segments: Vec<&str> = module.split('.').collect();
        self.rules
            .iter()
            .enumerate()
            .filter(|(_, (pattern, _))| {
                let pat: Vec<&str> = pattern.split('.').collect();
                pat.len() == segments.len()
                    && pat.iter().zip(&segments).all(|(p, s)| *p == "*" || p == s)
            })
            .map(|(i, _)| i)
            .collect()
    }
}

/// Why a plan could not be applied. Nothing is changed when it fails.
#[derive(Debug, Error)]
pub enum PlanError {
    /// A rule matched no parameter of the model (a misspelt path, or a module without
    /// parameters).
    #[error(
        "the plan's rule {split} {pattern:?} matches no parameter of the model (parameters: {examples})"
    )]
    NoMatch {
        /// The rule's pattern.
        pattern: String,
        /// The rule's split.
        split: Split,
        /// A few of the model's parameter paths, to compare with.
        examples: String,
    },
    /// Two rules matched one parameter.
    #[error(
        "parameter {param} is matched by two rules: {first} {first_pattern:?} and {second} {second_pattern:?}"
    )]
    Conflict {
        /// The parameter's path.
        param: String,
        /// The first rule's split and pattern.
        first: Split,
        /// Its pattern.
        first_pattern: String,
        /// The second rule's split.
        second: Split,
        /// Its pattern.
        second_pattern: String,
    },
    /// A split dimension does not divide among the group's ranks.
    #[error(
        "parameter {param} of shape {shape:?} cannot be split {split} over {ranks} ranks: its \
         dimension {dim} ({size}) is not a multiple of {ranks} x {parts} part(s)"
    )]
    NotDivisible {
        /// The parameter's path.
        param: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The rule.
        split: Split,
        /// The dimension that would be split.
        dim: usize,
        /// Its size.
        size: usize,
        /// Ranks in the group.
        ranks: usize,
        /// Parts of the rule.
        parts: usize,
    },
    /// A rule was applied to a parameter of a rank it does not know (a column rule on a
    /// convolution kernel).
    #[error(
        "parameter {param} has {rank} dimensions; a {split} rule splits linear weights (2) and biases (1)"
    )]
    WrongRank {
        /// The parameter's path.
        param: String,
        /// Its number of dimensions.
        rank: usize,
        /// The rule.
        split: Split,
    },
    /// Broadcasting rank 0's parameters failed.
    #[error("broadcasting parameter {param} from rank 0 of the tensor-parallel group: {source}")]
    Broadcast {
        /// The parameter's path.
        param: String,
        /// The collective's error.
        #[source]
        source: Box<CollectiveError>,
    },
    /// The group given is not the one `TensorParallel`'s ops run over on this thread.
    #[error(
        "the model is to be split over group {given} but TensorParallel ops on this thread run \
         over group {bound} (bind_thread or install the same communicator)"
    )]
    OtherGroup {
        /// The given group's id.
        given: u64,
        /// The bound group's id.
        bound: u64,
    },
    /// Installing the group failed (agreeing on a random seed).
    #[error("joining the tensor-parallel group: {0}")]
    Group(#[source] Box<CollectiveError>),
    /// `fully_shard` was called on a thread bound to a tensor-parallel group: parameters are
    /// sharded at rest over a fully sharded data-parallel group only (ZeRO stage 3 does not
    /// combine with tensor parallelism).
    #[error(
        "fully_shard needs a fully sharded data-parallel group, but this thread's group of {ranks} \
         ranks is a tensor-parallel one (ZeRO stage 3 does not combine with tensor parallelism)"
    )]
    NotFullySharded {
        /// Ranks in the bound group.
        ranks: usize,
    },
}

/// The placement `split` gives a parameter of `rank` dimensions.
fn placement_of(split: Split, rank: usize) -> Option<Placement> {
    match (split, rank) {
        (Split::Replicate, _) => Some(Placement::Replicate),
        (Split::Column { parts }, 2) => Some(Placement::Shard {
            dim: 1,
            blocks: parts,
        }),
        (Split::Column { parts }, 1) => Some(Placement::Shard {
            dim: 0,
            blocks: parts,
        }),
        (Split::Row, 2) | (Split::Vocab, 2) => Some(Placement::shard(0)),
        (Split::Row, 1) => Some(Placement::Replicate),
        _ => None,
    }
}

/// One parameter's decision.
struct Decision {
    path: String,
    placement: Placement,
}

/// Walks the model and decides each parameter's placement, checking the plan.
struct Planner<'a> {
    plan: &'a TpPlan,
    ranks: usize,
    path: Vec<String>,
    used: Vec<bool>,
    decisions: Vec<Decision>,
    all_paths: Vec<String>,
    error: Option<PlanError>,
}

impl<B: burn::tensor::backend::Backend> burn::module::ModuleVisitor<B> for Planner<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let module = self.path[..self.path.len().saturating_sub(1)].join(".");
        let path = self.path.join(".");
        self.all_paths.push(path.clone());
        let shape = param.shape();
        let matches = self.plan.matching(&module);
        let placement = match matches.as_slice() {
            [] => Placement::Replicate,
            [i] => {
                self.used[*i] = true;
                let split = self.plan.rules[*i].1;
                match placement_of(split, D) {
                    None => {
                        self.error.get_or_insert(PlanError::WrongRank {
                            param: path.clone(),
                            rank: D,
                            split,
                        });
                        Placement::Replicate
                    }
                    Some(p @ Placement::Shard { dim, blocks }) => {
                        if !divisible(&shape, dim, blocks, self.ranks) {
                            self.error.get_or_insert(PlanError::NotDivisible {
                                param: path.clone(),
                                shape: shape.to_vec(),
                                split,
                                dim,
                                size: shape[dim],
                                ranks: self.ranks,
                                parts: blocks,
                            });
                        }
                        p
                    }
                    Some(p) => p,
                }
            }
            [i, j, ..] => {
                self.used[*i] = true;
                self.used[*j] = true;
                let (a, b) = (&self.plan.rules[*i], &self.plan.rules[*j]);
                self.error.get_or_insert(PlanError::Conflict {
                    param: path.clone(),
                    first: a.1,
                    first_pattern: a.0.clone(),
                    second: b.1,
                    second_pattern: b.0.clone(),
                });
                Placement::Replicate
            }
        };
        self.decisions.push(Decision { path, placement });
    }
}

/// Replaces each parameter by rank 0's value, split as decided.
struct Resharder<'a> {
    decisions: std::vec::IntoIter<Decision>,
    comm: &'a Communicator,
    error: Option<PlanError>,
}

impl<B: TensorParallelBackend> ModuleMapper<B> for Resharder<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let decision = self.decisions.next().expect("one decision per parameter");
        let (id, tensor, mapper) = param.consume();
        if self.error.is_some() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let require_grad = tensor.is_require_grad();
        let tp = B::tp_part(tensor.clone().into_primitive().tensor());
        match broadcast_and_split::<B::Inner>(tp, decision.placement, self.comm) {
            Ok(tp) => {
                let split = Tensor::from_primitive(TensorPrimitive::Float(B::from_tp(tp)));
                let split = if require_grad {
                    split.require_grad()
                } else {
                    split
                };
                Param::from_mapped_value(id, split, mapper)
            }
            Err(source) => {
                self.error = Some(PlanError::Broadcast {
                    param: decision.path,
                    source: Box::new(source),
                });
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
    }
}

/// Rank 0's whole value of `t`, and this rank's part of it under `placement`.
fn broadcast_and_split<I: burn_backend::Backend>(
    t: TpTensor<I>,
    placement: Placement,
    comm: &Communicator,
) -> Result<TpTensor<I>, CollectiveError> {
    let shape = t.shape.clone();
    let full = whole::<I>(t, Why::Read);
    let full = if comm.size() > 1 {
        let device = I::float_device(&full);
        let data = futures::executor::block_on(I::float_into_data(full)).expect("readable");
        let (dtype, dshape) = (data.dtype, data.shape.clone());
        let bytes = comm.broadcast(data.into_bytes().to_vec(), 0).wait()?;
        if let Some(g) = context::current() {
            g.stats().broadcasts += 1;
        }
        I::float_from_data(
            burn_backend::TensorData::from_bytes_vec(bytes, dshape, dtype),
            &device,
        )
    } else {
        full
    };
    Ok(match placement {
        Placement::Shard { dim, blocks } => {
            let local = shard_of::<I>(full, dim, blocks, comm.size(), comm.rank());
            debug_assert_eq!(
                burn_backend::TensorMetadata::shape(&local),
                local_shape(&shape, placement, comm.size())
            );
            TpTensor::local(local, placement, Some(shape))
        }
        _ => TpTensor::replicated(full),
    })
}

/// Splits `model`'s parameters over `group` as `plan` says, Megatron-style, and returns the
/// model: each rank keeps only its part of each split parameter (1/ranks of its memory), taken
/// from rank 0's values (so ranks that initialised differently agree). The model's code is
/// unchanged: its ops run on `TensorParallel`, whose rules keep activations split between a
/// column and a row layer and sum a row layer's output with one all-reduce.
///
/// Collective: every rank of `group` calls it with the same plan and an identical model
/// structure. If neither [`super::bind_thread`] nor [`super::install`] has given this thread a
/// group, `group` is installed for the process. Errors (nothing changed): a rule matching no
/// parameter, two rules matching one, a dimension that does not divide among the ranks.
pub fn tensor_parallel<B, M>(model: M, plan: &TpPlan, group: &Communicator) -> Result<M, PlanError>
where
    B: TensorParallelBackend,
    M: Module<B>,
{
    // Under `DataParallel` (the hybrid), gradients are averaged shard by shard.
    super::hybrid::register::<B::Inner>();
    match context::current() {
        Some(bound) if bound.comm.id() != group.id() => {
            return Err(PlanError::OtherGroup {
                given: group.id().0,
                bound: bound.comm.id().0,
            });
        }
        Some(_) => {}
        None => context::install(group.clone(), FailurePolicy::Exit)
            .map_err(|e| PlanError::Group(Box::new(e)))?,
    }
    let mut planner = Planner {
        plan,
        ranks: group.size(),
        path: Vec::new(),
        used: vec![false; plan.rules.len()],
        decisions: Vec::new(),
        all_paths: Vec::new(),
        error: None,
    };
    model.visit(&mut planner);
    if let Some(e) = planner.error {
        return Err(e);
    }
    if let Some(i) = planner.used.iter().position(|u| !u) {
        let (pattern, split) = plan.rules[i].clone();
        let mut examples: Vec<String> = planner.all_paths.iter().take(6).cloned().collect();
        if planner.all_paths.len() > 6 {
            examples.push("...".into());
        }
        return Err(PlanError::NoMatch {
            pattern,
            split,
            examples: examples.join(", "),
        });
    }
    let mut resharder = Resharder {
        decisions: planner.decisions.into_iter(),
        comm: group,
        error: None,
    };
    let model = model.map(&mut resharder);
    match resharder.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// The placement of each parameter of `model`, by path (whole ones included).
pub fn placements<B, M>(model: &M) -> BTreeMap<String, Placement>
where
    B: TensorParallelBackend,
    M: Module<B>,
{
    struct Lister<B> {
        path: Vec<String>,
        out: BTreeMap<String, Placement>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: TensorParallelBackend> burn::module::ModuleVisitor<B> for Lister<B> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let tp = B::tp_part(param.val().into_primitive().tensor());
            self.out.insert(self.path.join("."), tp.placement());
        }
    }
    let mut lister = Lister::<B> {
        path: Vec::new(),
        out: BTreeMap::new(),
        _b: std::marker::PhantomData,
    };
    model.visit(&mut lister);
    lister.out
}
