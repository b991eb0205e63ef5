//! Per-rank checkpoints of a fully sharded run (ZeRO stage 3), as PyTorch's distributed
//! checkpoint saves an FSDP model: each rank writes the slices it holds of every parameter and
//! of the optimizer's state for it ([`save_sharded_checkpoint`], no gather, so no rank ever holds
//! the whole model or the whole state), and every rank writes the same `manifest.json` naming
//! each parameter's whole shape and split, the mesh, and every file's size and SHA-256.
//!
//! A save loads back on any number of ranks ([`load_sharded_checkpoint`]): on the mesh it was
//! written by, each rank reads only its own file and its slices are taken as they are, so the
//! run resumes bit for bit; on another, each rank's new slice of each parameter and of each
//! tensor of its state is copied together out of every rank's file, the files read one at a time
//! (so a rank never holds them all: the whole model and state). On one device, on any
//! autodiff backend, [`consolidate_sharded_checkpoint`] gives the whole model and the unwrapped
//! optimizer's record (save them with any Burn recorder), [`consolidate_sharded_model`] the
//! model alone on any backend, and [`shard_checkpoint`] turns a whole model and record back into
//! a save for `n` ranks. None of them communicates but `save_sharded_checkpoint`, which
//! all-gathers the files' sums.
//!
//! The optimizer's state for a parameter is stored as its record item (Burn's `Record`, in CBOR):
//! each tensor in it with the shape of the rank's slice of the parameter is taken to be that
//! slice (Adam's moments, SGD's momentum); any other was whole on every rank (AMSGrad's running
//! maximum, which stage 3 keeps whole) and is read from rank 0's file. Loaded on another mesh, a
//! tensor of the parameter's whole shape is cut like the parameter, as a whole state loaded at
//! stage 3 is (`Sharded::load_consolidated_record`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bonfire_collectives::CollectiveError;
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{Optimizer, SimpleOptimizer};
use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::backend::TensorParallelBackend;
use super::checkpoint::{cut, join};
use super::context;
use super::placement::Placement;
use super::redistribute::{Why, local_of, whole};
use super::tensor::TpTensor;
use crate::Sharded;

/// Why a sharded checkpoint could not be saved or loaded.
#[derive(Debug, Error)]
pub enum ShardedCheckpointError {
    /// A file could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A file is not what a sharded checkpoint holds (or is damaged).
    #[error("{path}: not a bonfire sharded checkpoint file: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The directory holds no complete save: no manifest, a rank's file missing, or a file that
    /// is not the one the manifest names.
    #[error("{dir}: no complete sharded checkpoint: {problem}")]
    Incomplete {
        /// The directory.
        dir: PathBuf,
        /// What is missing or different.
        problem: String,
    },
    /// The directory already holds a save.
    #[error(
        "{dir} already holds a sharded checkpoint (its manifest.json): save each one to a \
         directory of its own, so that a save cut short never replaces a complete one"
    )]
    Exists {
        /// The directory.
        dir: PathBuf,
    },
    /// The model does not have the checkpoint's parameters, or a saved value does not fit.
    #[error("{dir}: parameter {param}: {problem}")]
    Mismatch {
        /// The directory.
        dir: PathBuf,
        /// The parameter (its module path).
        param: String,
        /// How it differs.
        problem: String,
    },
    /// Several ranks share the model (data-parallel replicas, or a tensor-parallel group), but
    /// it is not sharded at rest over them.
    #[error(
        "{ranks} ranks share this model but it is not sharded at rest over them: a per-rank \
         checkpoint is for a model laid out by bonfire::fully_shard (ZeRO stage 3); save a \
         replicated model as a consolidated record on one rank, a tensor-parallel one with \
         tensor_parallel::save_shards"
    )]
    NotFullySharded {
        /// The group's size.
        ranks: usize,
    },
    /// The all-gather of the files' sizes and sums failed (a rank is gone).
    #[error("{what}: {source}")]
    Collective {
        /// What was exchanged.
        what: String,
        /// The collective's error.
        #[source]
        source: Box<CollectiveError>,
    },
}

type Result<T> = std::result::Result<T, ShardedCheckpointError>;

/// The unwrapped optimizer's record: each parameter's state, keyed by its id.
pub type StateRecord<O, M, B> = <OptimizerAdaptor<O, M, B> as Optimizer<M, B>>::Record;

const MAGIC: &str = "bonfire sharded checkpoint v1";
const FORMAT: &str = "bonfire sharded checkpoint v1";
/// The name of the manifest in a save's directory.
pub const MANIFEST: &str = "manifest.json";
/// Bytes of the SHA-256 that ends a rank's file.
const SUM_LEN: usize = 32;

/// Where a parameter is split: along `dim`, in `blocks` blocks each cut over the ranks.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
struct SplitAt {
    dim: usize,
    blocks: usize,
}

impl SplitAt {
    fn placement(self) -> Placement {
        Placement::Shard {
            dim: self.dim,
            blocks: self.blocks,
        }
    }

    /// The shape of one rank's slice of a tensor of `shape` split so over `ranks`.
    fn local(self, shape: &[usize], ranks: usize) -> Vec<usize> {
        let mut local = shape.to_vec();
        local[self.dim] /= ranks;
        local
    }
}

/// One parameter in a rank's file.
#[derive(Serialize, Deserialize, Clone)]
struct ParamPart {
    /// Its module path (`blocks.0.attn.qkv.weight`).
    path: String,
    /// Its id's number: the same on every rank for a trained parameter of a fully sharded run
    /// (rank 0's), each rank's own for a buffer (Burn's running statistics), so it is not in the
    /// manifest, which every rank writes alike.
    id: u64,
    /// Its whole shape.
    shape: Vec<usize>,
    /// Where it is split; `None` when every rank holds it whole.
    split: Option<SplitAt>,
    /// This rank's slice (the whole value when not split).
    data: TensorData,
    /// The optimizer's record item for it (CBOR), its tensors this rank's slices; `None` when the
    /// optimizer has no state for it (not stepped yet, or not trained).
    state: Option<Vec<u8>>,
}

#[derive(Serialize, Deserialize)]
struct RankFile {
    magic: String,
    rank: usize,
    ranks: usize,
    params: Vec<ParamPart>,
}

/// `manifest.json`: what the save holds, written identically by every rank.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
struct Manifest {
    format: String,
    /// The number of ranks that wrote it (the fully sharded group's size; 1 on one device).
    ranks: usize,
    /// The optimizer's type, as Rust names it.
    optimizer: String,
    params: Vec<ManifestParam>,
    files: Vec<ManifestFile>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
struct ManifestParam {
    path: String,
    shape: Vec<usize>,
    split: Option<SplitAt>,
    dtype: String,
    state: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
struct ManifestFile {
    name: String,
    bytes: u64,
    sha256: String,
}

fn sha256(bytes: &[u8]) -> [u8; SUM_LEN] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

fn hex(sum: &[u8]) -> String {
    sum.iter().map(|b| format!("{b:02x}")).collect()
}

/// The name of rank `rank`'s file in a save by `ranks` ranks.
pub fn rank_file_name(rank: usize, ranks: usize) -> String {
    format!("zero3-rank{rank}-of-{ranks}.bin")
}

/// This rank and the number of ranks a save is cut over, and the group's communicator when
/// there are several: the fully sharded group, or one rank alone. Several data-parallel ranks
/// without a fully sharded group over them is an error.
fn mesh<D: burn_backend::DeviceOps>(
    device: &D,
) -> Result<(usize, usize, Option<bonfire_collectives::Communicator>)> {
    if context::fully_sharded()
        && let Some(g) = context::current().filter(|g| g.size() > 1)
    {
        return Ok((g.rank(), g.size(), Some(g.comm.clone())));
    }
    // A tensor-parallel group (not fully sharded): its ranks hold other parts of one replica.
    if let Some(g) = context::current().filter(|g| g.size() > 1) {
        return Err(ShardedCheckpointError::NotFullySharded { ranks: g.size() });
    }
    let dp = crate::data_parallel::communicator(device).size();
    if dp > 1 {
        return Err(ShardedCheckpointError::NotFullySharded { ranks: dp });
    }
    Ok((0, 1, None))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ShardedCheckpointError + '_ {
    move |source| ShardedCheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` through a temporary file renamed into place.
fn write_atomically(path: &Path, tmp: &Path, parts: &[&[u8]]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(tmp).map_err(io(tmp))?;
    for p in parts {
        f.write_all(p).map_err(io(tmp))?;
    }
    f.sync_all().map_err(io(tmp))?;
    std::fs::rename(tmp, path).map_err(io(path))
}

/// Writes rank `file.rank`'s file in `dir`; its name, size and SHA-256 for the manifest.
fn write_rank_file(dir: &Path, file: &RankFile) -> Result<ManifestFile> {
    let name = rank_file_name(file.rank, file.ranks);
    let path = dir.join(&name);
    let body = postcard::to_stdvec(file).map_err(|e| ShardedCheckpointError::Format {
        path: path.clone(),
        reason: format!("encoding it: {e}"),
    })?;
    // The body is hashed once: its sum ends the file, and the whole file's sum (the manifest's)
    // continues from it over that trailer.
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    hasher.update(&body);
    let trailer: [u8; SUM_LEN] = hasher.clone().finalize().into();
    write_atomically(&path, &path.with_extension("bin.tmp"), &[&body, &trailer])?;
    hasher.update(trailer);
    let sum: [u8; SUM_LEN] = hasher.finalize().into();
    Ok(ManifestFile {
        name,
        bytes: (body.len() + SUM_LEN) as u64,
        sha256: hex(&sum),
    })
}

fn manifest_of(
    ranks: usize,
    optimizer: &str,
    params: Vec<ManifestParam>,
    files: Vec<ManifestFile>,
) -> Manifest {
    Manifest {
        format: FORMAT.into(),
        ranks,
        optimizer: optimizer.into(),
        params,
        files,
    }
}

/// `file`'s parameters as the manifest lists them.
fn listed(file: &RankFile) -> Vec<ManifestParam> {
    file.params
        .iter()
        .map(|p| ManifestParam {
            path: p.path.clone(),
            shape: p.shape.clone(),
            split: p.split,
            dtype: format!("{:?}", p.data.dtype),
            state: p.state.is_some(),
        })
        .collect()
}

fn write_manifest(dir: &Path, manifest: &Manifest, rank: usize) -> Result<PathBuf> {
    let path = dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| ShardedCheckpointError::Format {
        path: path.clone(),
        reason: format!("encoding it: {e}"),
    })?;
    let tmp = dir.join(format!("{MANIFEST}.tmp-rank{rank}"));
    write_atomically(&path, &tmp, &[&json])?;
    Ok(path)
}

/// The optimizer's record item for one parameter as CBOR bytes (its tensors as this rank reads
/// them).
fn encode_item<T: Serialize>(item: &T) -> std::result::Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    ciborium::into_writer(item, &mut bytes).map_err(|e| e.to_string())?;
    Ok(bytes)
}

/// Saves this rank's part of a fully sharded run to `dir`: its slice of every parameter of
/// `model` and the state `optim` keeps for it, in `dir/zero3-rank<r>-of-<n>.bin` (a temporary
/// file renamed into place, ending in its SHA-256), then `dir/manifest.json`, the same from every
/// rank, once every rank's file is written. Returns this rank's file.
///
/// Collective over the fully sharded group: every rank calls it with the same `dir` (a shared
/// file system, or each node's own disk: each rank then writes its own file and the manifest
/// there). Nothing is gathered: a rank writes what it holds. On one device (no group, or a
/// group of one) it writes a save of one rank. `dir` must not hold a save already.
///
/// Errors: several data-parallel ranks but a model not laid out by [`crate::fully_shard`]; `dir`
/// holds a save; a file cannot be written; a rank is gone.
pub fn save_sharded_checkpoint<B, M, O>(
    dir: &Path,
    model: &M,
    optim: &Sharded<OptimizerAdaptor<O, M, B>>,
) -> Result<PathBuf>
where
    B: AutodiffBackend + TensorParallelBackend,
    M: AutodiffModule<B>,
    O: SimpleOptimizer<B::InnerBackend>,
{
    let device = model.devices().into_iter().next().unwrap_or_default();
    let (rank, ranks, comm) = mesh(&device)?;
    // Every rank enters the exchange of the files' sums, a failed one saying so, so that a rank
    // that cannot write fails every rank at once, naming it, instead of leaving them waiting.
    let mine = write_own(dir, model, optim, rank, ranks);
    let Some(comm) = comm else {
        // One rank: the manifest names its file alone.
        let (own, params) = mine?;
        let manifest = manifest_of(1, std::any::type_name::<O>(), params, vec![own]);
        write_manifest(dir, &manifest, rank)?;
        return Ok(dir.join(rank_file_name(rank, ranks)));
    };
    let words = match &mine {
        Ok((m, _)) => [vec![m.bytes as i64], u8_words(&m.sha256)].concat(),
        Err(_) => vec![-1i64; 5],
    };
    let all = comm.all_gather(words).wait().map_err(|source| {
        ShardedCheckpointError::Collective {
            what: format!(
                "all-gather of the {ranks} sharded checkpoint files' sizes and sums (rank {rank} \
                 wrote to {})",
                dir.display()
            ),
            source: Box::new(source),
        }
    })?;
    // This rank's own error first; then the first other rank that could not write.
    let (own, params) = mine?;
    if let Some(r) = (0..ranks).find(|&r| all[5 * r] < 0) {
        return Err(ShardedCheckpointError::Incomplete {
            dir: dir.to_path_buf(),
            problem: format!(
                "rank {r} could not write its file {} (its own error says why)",
                rank_file_name(r, ranks)
            ),
        });
    }
    let files = all
        .chunks(5)
        .enumerate()
        .map(|(r, w)| ManifestFile {
            name: rank_file_name(r, ranks),
            bytes: w[0] as u64,
            sha256: if r == rank {
                own.sha256.clone()
            } else {
                words_hex(&w[1..])
            },
        })
        .collect();
    let manifest = manifest_of(ranks, std::any::type_name::<O>(), params, files);
    write_manifest(dir, &manifest, rank)?;
    Ok(dir.join(rank_file_name(rank, ranks)))
}

/// This rank's file of a save in `dir`, written: its name, size and SHA-256, and its parameters
/// as the manifest lists them.
fn write_own<B, M, O>(
    dir: &Path,
    model: &M,
    optim: &Sharded<OptimizerAdaptor<O, M, B>>,
    rank: usize,
    ranks: usize,
) -> Result<(ManifestFile, Vec<ManifestParam>)>
where
    B: AutodiffBackend + TensorParallelBackend,
    M: AutodiffModule<B>,
    O: SimpleOptimizer<B::InnerBackend>,
{
    if dir.join(MANIFEST).exists() {
        return Err(ShardedCheckpointError::Exists {
            dir: dir.to_path_buf(),
        });
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    struct Collect<O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
        path: Vec<String>,
        states: HashMap<ParamId, AdaptorRecord<O, B>>,
        params: Vec<ParamPart>,
        error: Option<String>,
    }
    impl<O, B> ModuleVisitor<B> for Collect<O, B>
    where
        O: SimpleOptimizer<B::InnerBackend>,
        B: AutodiffBackend + TensorParallelBackend,
    {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self.path.join(".");
            let tp = B::tp_part(param.val().into_primitive().tensor());
            let shape = tp.shape.to_vec();
            let (split, local) = match tp.placement() {
                Placement::Shard { dim, blocks } => {
                    (Some(SplitAt { dim, blocks }), local_of::<B::Inner>(tp))
                }
                // Whole on every rank (a pending sum, which no parameter is, is summed).
                _ => (None, whole::<B::Inner>(tp, Why::Read)),
            };
            let data =
                futures::executor::block_on(<B::Inner as burn_backend::ops::FloatTensorOps<
                    B::Inner,
                >>::float_into_data(local))
                .expect("a parameter can be read to the host");
            let state = self.states.remove(&param.id).map(|record| {
                let item = context::read_parts(|| record.into_item::<FullPrecisionSettings>());
                encode_item(&item).unwrap_or_else(|e| {
                    self.error
                        .get_or_insert(format!("encoding the state of {path}: {e}"));
                    Vec::new()
                })
            });
            self.params.push(ParamPart {
                path,
                id: param.id.val(),
                shape,
                split,
                data,
                state,
            });
        }
    }
    let mut collect = Collect::<O, B> {
        path: Vec::new(),
        states: optim.inner().to_record().into_iter().collect(),
        params: Vec::new(),
        error: None,
    };
    model.visit(&mut collect);
    if let Some(reason) = collect.error {
        return Err(ShardedCheckpointError::Format {
            path: dir.join(rank_file_name(rank, ranks)),
            reason,
        });
    }
    let file = RankFile {
        magic: MAGIC.into(),
        rank,
        ranks,
        params: collect.params,
    };
    Ok((write_rank_file(dir, &file)?, listed(&file)))
}

/// A SHA-256 in hex as four words, for an all-gather of `i64`s.
fn u8_words(hex_sum: &str) -> Vec<i64> {
    (0..4)
        .map(|i| {
            let word = &hex_sum[i * 16..(i + 1) * 16];
            u64::from_str_radix(word, 16).unwrap_or(0) as i64
        })
        .collect()
}

fn words_hex(words: &[i64]) -> String {
    words
        .iter()
        .map(|&w| format!("{:016x}", w as u64))
        .collect()
}

/// One rank's part of a tensor: the tensor split as `split` over `ranks` (whole when `None`),
/// rank `rank`'s slice.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Part {
    split: Option<SplitAt>,
    ranks: usize,
    rank: usize,
}

impl Part {
    const WHOLE: Part = Part {
        split: None,
        ranks: 1,
        rank: 0,
    };

    /// The part's shape, of a tensor of `shape`.
    fn shape(self, shape: &[usize]) -> Vec<usize> {
        match self.split {
            Some(s) => s.local(shape, self.ranks),
            None => shape.to_vec(),
        }
    }

    /// The ranges of dimension `dim` (of size `size`) the part holds, in its own order.
    fn ranges(self, dim: usize, size: usize) -> Vec<std::ops::Range<usize>> {
        match self.split {
            Some(s) if s.dim == dim => {
                super::placement::owned_ranges(size, s.blocks, self.ranks, self.rank)
            }
            _ => std::iter::once(0..size).collect(),
        }
    }
}

/// Copies into `to`, part `into` of a tensor of `shape` (row-major bytes, `elem` bytes an
/// element), every element it shares with `from`, part `of` of the same tensor: what the two
/// parts overlap in, and nothing else (a saved rank's slice into a new rank's, without the whole
/// tensor).
fn copy_overlap(shape: &[usize], elem: usize, from: &[u8], of: Part, to: &mut [u8], into: Part) {
    // Per dimension, the runs both parts hold: (length, start in `from`'s part, start in `to`'s).
    let runs: Vec<Vec<(usize, usize, usize)>> = (shape.iter().enumerate())
        .map(|(dim, &size)| {
            let (a, b) = (of.ranges(dim, size), into.ranges(dim, size));
            let (mut out, mut at_a, mut at_b) = (Vec::new(), 0, 0);
            let (mut ia, mut ib) = (a.iter().peekable(), b.iter().peekable());
            while let (Some(ra), Some(rb)) = (ia.peek(), ib.peek()) {
                let (lo, hi) = (ra.start.max(rb.start), ra.end.min(rb.end));
                if lo < hi {
                    out.push((hi - lo, at_a + lo - ra.start, at_b + lo - rb.start));
                }
                if ra.end <= rb.end {
                    at_a += ra.len();
                    ia.next();
                } else {
                    at_b += rb.len();
                    ib.next();
                }
            }
            out
        })
        .collect();
    let strides = |local: &[usize]| {
        let mut strides = vec![elem; local.len()];
        for d in (0..local.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * local[d + 1];
        }
        strides
    };
    let (sf, st) = (strides(&of.shape(shape)), strides(&into.shape(shape)));
    fn walk(
        dim: usize,
        runs: &[Vec<(usize, usize, usize)>],
        (sf, st): (&[usize], &[usize]),
        (from, to): (&[u8], &mut [u8]),
        (at_from, at_to): (usize, usize),
    ) {
        if dim + 1 == runs.len() {
            for &(len, a, b) in &runs[dim] {
                let (f, t) = (at_from + a * sf[dim], at_to + b * st[dim]);
                to[t..t + len * st[dim]].copy_from_slice(&from[f..f + len * sf[dim]]);
            }
            return;
        }
        for &(len, a, b) in &runs[dim] {
            for j in 0..len {
                let at = (at_from + (a + j) * sf[dim], at_to + (b + j) * st[dim]);
                walk(dim + 1, runs, (sf, st), (from, &mut *to), at);
            }
        }
    }
    if shape.is_empty() {
        to.copy_from_slice(from);
    } else {
        walk(0, &runs, (&sf, &st), (from, to), (0, 0));
    }
}

/// What a load wants of one saved parameter on another mesh: its index in the save and the
/// part the loading rank takes.
struct Want {
    index: usize,
    part: Part,
}

/// A wanted parameter's part and the optimizer's record item for it, put together from every
/// rank's file ([`Save::stream`]).
struct Streamed {
    /// The part it was put together for.
    part: Part,
    /// The parameter's saved id (rank 0's).
    id: u64,
    /// The parameter's part, until taken.
    data: Option<TensorData>,
    /// Its state's record item, until taken (`None` when the save has no state for it).
    state: Option<ciborium::Value>,
}

/// A save's manifest and its rank files, each read, checked (size and SHA-256 against the
/// manifest, its own trailing sum, its rank and parameters against the manifest) when first
/// needed.
struct Save {
    dir: PathBuf,
    manifest: Manifest,
    files: Vec<Option<RankFile>>,
    /// Each saved parameter's index, by module path.
    index: HashMap<String, usize>,
    /// The saved parameters the model has named so far ([`Save::locate`]).
    seen: Vec<bool>,
    /// Parts put together ahead by [`Save::stream`], by index, until taken.
    streamed: HashMap<usize, Streamed>,
    /// The most rank files this save has held in memory at once.
    held_most: usize,
}

impl Save {
    fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let incomplete = |problem: String| ShardedCheckpointError::Incomplete {
            dir: dir.to_path_buf(),
            problem,
        };
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(incomplete(format!(
                    "no {MANIFEST} (a save writes it last, once every rank's file is written)"
                )));
            }
            Err(source) => return Err(ShardedCheckpointError::Io { path, source }),
        };
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| ShardedCheckpointError::Format {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        if manifest.format != FORMAT {
            return Err(ShardedCheckpointError::Format {
                path,
                reason: format!("its format is {:?}, not {FORMAT:?}", manifest.format),
            });
        }
        if manifest.ranks == 0 || manifest.files.len() != manifest.ranks {
            return Err(ShardedCheckpointError::Format {
                path,
                reason: format!(
                    "it names {} files for {} ranks",
                    manifest.files.len(),
                    manifest.ranks
                ),
            });
        }
        let files = (0..manifest.ranks).map(|_| None).collect();
        let index = (manifest.params.iter().enumerate())
            .map(|(i, p)| (p.path.clone(), i))
            .collect();
        let seen = vec![false; manifest.params.len()];
        Ok(Save {
            dir: dir.to_path_buf(),
            manifest,
            files,
            index,
            seen,
            streamed: HashMap::new(),
            held_most: 0,
        })
    }

    fn file(&mut self, rank: usize) -> Result<&RankFile> {
        if self.files[rank].is_none() {
            let file = self.read(rank)?;
            self.files[rank] = Some(file);
            let held = self.files.iter().filter(|f| f.is_some()).count();
            self.held_most = self.held_most.max(held);
        }
        Ok(self.files[rank].as_ref().expect("just read"))
    }

    /// Puts together, ahead of the load that takes them ([`Save::value`], [`Save::state`]),
    /// the `wanted` parts of parameters and (`with_state`) of their state, reading the rank
    /// files one at a time and letting each go before the next: a rank loading at another mesh
    /// holds one file and its own parts, never every file (the whole model and state).
    fn stream(&mut self, wanted: &[Want], with_state: bool) -> Result<()> {
        if wanted.is_empty() {
            return Ok(());
        }
        let (saved_ranks, dir) = (self.manifest.ranks, self.dir.clone());
        for w in wanted {
            let saved = &self.manifest.params[w.index];
            if let Some(s) = w.part.split {
                let size = saved.shape.get(s.dim).copied().unwrap_or(0);
                if s.blocks == 0 || !size.is_multiple_of(s.blocks * w.part.ranks) {
                    return Err(self.mismatch(
                        &saved.path,
                        format!(
                            "dimension {} of {:?} does not split in {} blocks over {} ranks",
                            s.dim, saved.shape, s.blocks, w.part.ranks
                        ),
                    ));
                }
            }
        }
        let decode = |path: &str, bytes: &[u8]| -> Result<ciborium::Value> {
            ciborium::from_reader(bytes).map_err(|e| ShardedCheckpointError::Mismatch {
                dir: dir.clone(),
                param: path.to_string(),
                problem: format!("its state: {e}"),
            })
        };
        let differ = |path: &str, problem: &str| ShardedCheckpointError::Mismatch {
            dir: dir.clone(),
            param: path.to_string(),
            problem: format!("its state: the ranks' states hold different tensors ({problem})"),
        };
        // Per wanted parameter: its part's bytes; and its state's tree (rank 0's, its tensors
        // taken out) with each of the tree's tensors as it will be (a slice filled from every
        // rank's), whether rank 0's was a slice, and its dtype.
        struct Made {
            bytes: Vec<u8>,
            shape: Vec<usize>,
            dtype: burn::tensor::DType,
            slice: bool,
        }
        struct Building {
            data: Vec<u8>,
            dtype: burn::tensor::DType,
            id: u64,
            tree: Option<ciborium::Value>,
            tensors: Vec<Made>,
        }
        let mut building: Vec<Building> = Vec::with_capacity(wanted.len());
        for r in 0..saved_ranks {
            let file = match self.files[r].take() {
                Some(file) => file,
                None => self.read(r)?,
            };
            self.held_most = self.held_most.max(1 + self.files.iter().flatten().count());
            let saved_part = |split| Part {
                split,
                ranks: saved_ranks,
                rank: r,
            };
            for (k, w) in wanted.iter().enumerate() {
                let saved = &self.manifest.params[w.index];
                let held = &file.params[w.index];
                // `read` checked the part's shape and dtype against the manifest.
                let dtype = held.data.dtype;
                let elem = dtype.size();
                if r == 0 {
                    let len = w.part.shape(&saved.shape).iter().product::<usize>() * elem;
                    building.push(Building {
                        data: vec![0u8; len],
                        dtype,
                        id: held.id,
                        tree: None,
                        tensors: Vec::new(),
                    });
                }
                let b = &mut building[k];
                // An unsplit parameter is every rank's alike: rank 0's is taken.
                if saved.split.is_some() || r == 0 {
                    let of = saved_part(saved.split);
                    copy_overlap(
                        &saved.shape,
                        elem,
                        held.data.as_bytes(),
                        of,
                        &mut b.data,
                        w.part,
                    );
                }
                if !with_state || !saved.state || (r > 0 && saved.split.is_none()) {
                    continue;
                }
                let bytes = held.state.clone().unwrap_or_default();
                let mut tree = decode(&saved.path, &bytes)?;
                let found = tensors(&tree);
                if let Some(t) = found.iter().find(|t| {
                    t.as_bytes().len() != t.shape.iter().product::<usize>() * t.dtype.size()
                }) {
                    return Err(differ(
                        &saved.path,
                        &format!("a tensor of shape {:?} has other bytes", t.shape),
                    ));
                }
                let saved_local = saved.split.map(|s| s.local(&saved.shape, saved_ranks));
                let is_slice =
                    |t: &TensorData| saved_local.as_ref().is_some_and(|l| t.shape.to_vec() == *l);
                if r == 0 {
                    b.tensors = found
                        .iter()
                        .map(|t| {
                            // A slice of every rank's, or one whole on every rank (cut like the
                            // parameter where it has the parameter's shape).
                            let slice = is_slice(t);
                            let (of, whole_shape) = if slice {
                                (saved_part(saved.split), saved.shape.clone())
                            } else {
                                (Part::WHOLE, t.shape.to_vec())
                            };
                            let into = if whole_shape == saved.shape {
                                w.part
                            } else {
                                Part::WHOLE
                            };
                            let shape = into.shape(&whole_shape);
                            let len = shape.iter().product::<usize>() * t.dtype.size();
                            let mut bytes = vec![0u8; len];
                            let elem = t.dtype.size();
                            copy_overlap(&whole_shape, elem, t.as_bytes(), of, &mut bytes, into);
                            Made {
                                bytes,
                                shape,
                                dtype: t.dtype,
                                slice,
                            }
                        })
                        .collect();
                    // Only the tree's shape is kept until the end: its tensors are in `tensors`.
                    map_tensors(&mut tree, &mut |t| {
                        TensorData::from_bytes_vec(Vec::new(), vec![0], t.dtype)
                    });
                    b.tree = Some(tree);
                } else {
                    if found.len() != b.tensors.len() {
                        return Err(differ(
                            &saved.path,
                            &format!(
                                "{} tensors on rank {r}, {} on rank 0",
                                found.len(),
                                b.tensors.len()
                            ),
                        ));
                    }
                    for (t, made) in found.iter().zip(&mut b.tensors) {
                        if is_slice(t) != made.slice || t.dtype != made.dtype {
                            return Err(differ(
                                &saved.path,
                                &format!("a {:?} of shape {:?} on rank {r}", t.dtype, t.shape),
                            ));
                        }
                        if made.slice {
                            let of = saved_part(saved.split);
                            let elem = t.dtype.size();
                            let (from, into) = (t.as_bytes(), &mut made.bytes);
                            copy_overlap(&saved.shape, elem, from, of, into, w.part);
                        }
                    }
                }
            }
            drop(file);
        }
        for (w, b) in wanted.iter().zip(building) {
            let saved = &self.manifest.params[w.index];
            let data = TensorData::from_bytes_vec(b.data, w.part.shape(&saved.shape), b.dtype);
            let state = b.tree.map(|mut tree| {
                let mut made = b.tensors.into_iter();
                map_tensors(&mut tree, &mut |t| match made.next() {
                    Some(m) => TensorData::from_bytes_vec(m.bytes, m.shape, m.dtype),
                    None => t,
                });
                tree
            });
            let streamed = Streamed {
                part: w.part,
                id: b.id,
                data: Some(data),
                state,
            };
            self.streamed.insert(w.index, streamed);
        }
        Ok(())
    }

    fn read(&self, rank: usize) -> Result<RankFile> {
        let m = &self.manifest;
        let named = &m.files[rank];
        let path = self.dir.join(&named.name);
        let incomplete = |problem: String| ShardedCheckpointError::Incomplete {
            dir: self.dir.clone(),
            problem,
        };
        if named.name != rank_file_name(rank, m.ranks) {
            return Err(ShardedCheckpointError::Format {
                path: self.dir.join(MANIFEST),
                reason: format!("it names {} as rank {rank}'s file", named.name),
            });
        }
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(incomplete(format!(
                    "rank {rank}'s file {} is missing",
                    named.name
                )));
            }
            Err(source) => return Err(ShardedCheckpointError::Io { path, source }),
        };
        let sum = hex(&sha256(&bytes));
        if bytes.len() as u64 != named.bytes || sum != named.sha256 {
            return Err(incomplete(format!(
                "{} has {} bytes and SHA-256 {sum}, the manifest says {} bytes and {}: it was \
                 changed, cut short or written by another save",
                named.name,
                bytes.len(),
                named.bytes,
                named.sha256
            )));
        }
        let format = |reason: String| ShardedCheckpointError::Format {
            path: path.clone(),
            reason,
        };
        let Some((body, trailer)) = bytes.split_last_chunk::<SUM_LEN>() else {
            return Err(format("it is shorter than its checksum".into()));
        };
        if sha256(body) != *trailer {
            return Err(format("it does not match its own checksum".into()));
        }
        let file: RankFile = postcard::from_bytes(body).map_err(|e| format(e.to_string()))?;
        if file.magic != MAGIC {
            return Err(format(format!("it starts with {:?}", file.magic)));
        }
        if (file.rank, file.ranks) != (rank, m.ranks) {
            return Err(format(format!(
                "it holds rank {} of {}, its name rank {rank} of {}",
                file.rank, file.ranks, m.ranks
            )));
        }
        let listed: Vec<ManifestParam> = listed(&file);
        if listed != m.params {
            return Err(format(
                "its parameters (paths, shapes, splits, dtypes) are not the manifest's".into(),
            ));
        }
        for p in &file.params {
            let expect = match p.split {
                Some(s) => s.local(&p.shape, m.ranks),
                None => p.shape.clone(),
            };
            if p.data.shape.to_vec() != expect {
                return Err(format(format!(
                    "{}'s part has shape {:?}, {expect:?} expected",
                    p.path, p.data.shape
                )));
            }
        }
        Ok(file)
    }

    /// An error unless the save's optimizer state is `O`'s (or it holds none).
    fn check_optimizer<O>(&self) -> Result<()> {
        let mine = std::any::type_name::<O>();
        let has_state = self.manifest.params.iter().any(|p| p.state);
        if has_state && self.manifest.optimizer != mine {
            return Err(ShardedCheckpointError::Format {
                path: self.dir.join(MANIFEST),
                reason: format!(
                    "its optimizer state is {}'s, not {mine}'s",
                    self.manifest.optimizer
                ),
            });
        }
        Ok(())
    }

    /// The index of the model's parameter `name`, of `shape`, in the save (marked seen), or why
    /// the save has no such parameter.
    fn locate(&mut self, name: &str, shape: &[usize]) -> Result<usize> {
        let Some(&i) = self.index.get(name) else {
            return Err(self.mismatch(name, "the checkpoint has no such parameter".into()));
        };
        self.seen[i] = true;
        let saved = &self.manifest.params[i].shape;
        if saved != shape {
            return Err(self.mismatch(
                name,
                format!("shape {saved:?} in the checkpoint, {shape:?} in the model"),
            ));
        }
        Ok(i)
    }

    fn mismatch(&self, param: &str, problem: String) -> ShardedCheckpointError {
        ShardedCheckpointError::Mismatch {
            dir: self.dir.clone(),
            param: param.to_string(),
            problem,
        }
    }

    /// Whether parameter `i` is held by rank `rank` of `ranks` exactly as it was saved, so that
    /// the rank's own file holds its part.
    fn same_mesh(&self, i: usize, ranks: usize, split: Option<SplitAt>) -> bool {
        self.manifest.ranks == ranks && self.manifest.params[i].split == split
    }

    /// Rank `rank`'s part of parameter `i` for a mesh of `ranks` that splits it as `split`.
    fn value(
        &mut self,
        i: usize,
        rank: usize,
        ranks: usize,
        split: Option<SplitAt>,
    ) -> Result<TensorData> {
        if let Some(data) = self.take_streamed(i, Part { split, ranks, rank }, |s| s.data.take()) {
            return Ok(data);
        }
        if self.same_mesh(i, ranks, split) {
            return Ok(self.file(rank)?.params[i].data.clone());
        }
        let saved = self.manifest.params[i].clone();
        let whole = match saved.split {
            None => self.file(0)?.params[i].data.clone(),
            Some(s) => {
                let parts = self.all(|f| f.params[i].data.clone())?;
                let parts: Vec<&TensorData> = parts.iter().collect();
                join(&parts, &saved.shape, s.dim, s.blocks)
                    .map_err(|p| self.mismatch(&saved.path, p))?
            }
        };
        self.recut(&saved.path, whole, rank, ranks, split)
    }

    /// Parameter `i`'s saved id (rank 0's).
    fn saved_id(&mut self, i: usize) -> Result<u64> {
        match self.streamed.get(&i) {
            Some(s) => Ok(s.id),
            None => Ok(self.file(0)?.params[i].id),
        }
    }

    /// The parts of the model's parameters that this rank takes and that its own file does not
    /// hold as they are (every part, on another mesh), as `part_of` a parameter's value says
    /// (`None` for a parameter not drawn yet, which this pass leaves undrawn); each parameter is
    /// located in the save (errors as [`Save::locate`]'s).
    fn wanted<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(
        &mut self,
        model: &M,
        part_of: impl Fn(Option<TensorPrimitive<B>>) -> Part,
    ) -> Result<Vec<Want>> {
        struct Wants<'a, F> {
            save: &'a mut Save,
            part_of: F,
            path: Vec<String>,
            wanted: Vec<Want>,
            error: Option<ShardedCheckpointError>,
        }
        impl<B, F> ModuleVisitor<B> for Wants<'_, F>
        where
            B: burn::tensor::backend::Backend,
            F: Fn(Option<TensorPrimitive<B>>) -> Part,
        {
            fn enter_module(&mut self, name: &str, _container_type: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _name: &str, _container_type: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if self.error.is_some() {
                    return;
                }
                let name = self.path.join(".");
                match self.save.locate(&name, &param.lazy_shape().to_vec()) {
                    Ok(i) => {
                        let drawn = param.is_initialized().then(|| param.val().into_primitive());
                        let part = (self.part_of)(drawn);
                        if !self.save.same_mesh(i, part.ranks, part.split) {
                            self.wanted.push(Want { index: i, part });
                        }
                    }
                    Err(e) => self.error = Some(e),
                }
            }
        }
        let mut wants = Wants {
            save: self,
            part_of,
            path: Vec::new(),
            wanted: Vec::new(),
            error: None,
        };
        model.visit(&mut wants);
        match wants.error {
            Some(e) => Err(e),
            None => Ok(wants.wanted),
        }
    }

    /// What `take` takes of parameter `i`'s [`Save::stream`]ed part, if it was put together
    /// for `part`.
    fn take_streamed<T>(
        &mut self,
        i: usize,
        part: Part,
        take: impl FnOnce(&mut Streamed) -> Option<T>,
    ) -> Option<T> {
        self.streamed
            .get_mut(&i)
            .filter(|s| s.part == part)
            .and_then(take)
    }

    /// `whole` cut for rank `rank` of `ranks` as `split` says (whole when `None`).
    fn recut(
        &self,
        param: &str,
        whole: TensorData,
        rank: usize,
        ranks: usize,
        split: Option<SplitAt>,
    ) -> Result<TensorData> {
        match split {
            None => Ok(whole),
            Some(s) => {
                cut(&whole, s.dim, s.blocks, ranks, rank).map_err(|p| self.mismatch(param, p))
            }
        }
    }

    /// `f` of every rank's file, in rank order.
    fn all<T>(&mut self, f: impl Fn(&RankFile) -> T) -> Result<Vec<T>> {
        (0..self.manifest.ranks)
            .map(|r| self.file(r).map(&f))
            .collect()
    }

    /// The optimizer's record item for parameter `i`, its tensors rank `rank`'s slices for a
    /// mesh of `ranks` that splits the parameter as `split` (whole when `None`); `None` when the
    /// save has no state for it.
    fn state(
        &mut self,
        i: usize,
        rank: usize,
        ranks: usize,
        split: Option<SplitAt>,
    ) -> Result<Option<ciborium::Value>> {
        if !self.manifest.params[i].state {
            return Ok(None);
        }
        let streamed = self.take_streamed(i, Part { split, ranks, rank }, |s| s.state.take());
        if streamed.is_some() {
            return Ok(streamed);
        }
        let saved = self.manifest.params[i].clone();
        let dir = self.dir.clone();
        let decode = |path: &str, bytes: &[u8]| -> Result<ciborium::Value> {
            ciborium::from_reader(bytes).map_err(|e| ShardedCheckpointError::Mismatch {
                dir: dir.clone(),
                param: path.to_string(),
                problem: format!("its state: {e}"),
            })
        };
        let own = |file: &RankFile| file.params[i].state.clone().unwrap_or_default();
        if self.same_mesh(i, ranks, split) {
            let bytes = own(self.file(rank)?);
            return decode(&saved.path, &bytes).map(Some);
        }
        let first = own(self.file(0)?);
        let mut tree = decode(&saved.path, &first)?;
        // Every rank's tensors in the tree's order; rank 0's tree is rewritten in place.
        let parts: Vec<Vec<TensorData>> = match saved.split {
            None => Vec::new(),
            Some(_) => {
                let all = self.all(own)?;
                all.iter()
                    .map(|b| decode(&saved.path, b).map(|v| tensors(&v)))
                    .collect::<Result<_>>()?
            }
        };
        let saved_local = saved
            .split
            .map(|s| s.local(&saved.shape, self.manifest.ranks));
        let mut k = 0;
        let mut problem = None;
        map_tensors(&mut tree, &mut |t: TensorData| {
            let at = k;
            k += 1;
            let whole = match (saved.split, &saved_local) {
                (Some(s), Some(local)) if t.shape.to_vec() == *local => {
                    let mine: Vec<&TensorData> = parts.iter().filter_map(|p| p.get(at)).collect();
                    if mine.len() != parts.len() {
                        problem.get_or_insert("the ranks' states hold different tensors".into());
                        return t;
                    }
                    match join(&mine, &saved.shape, s.dim, s.blocks) {
                        Ok(w) => w,
                        Err(p) => {
                            problem.get_or_insert(p);
                            return t;
                        }
                    }
                }
                _ => t,
            };
            match split {
                Some(s) if whole.shape.to_vec() == saved.shape => {
                    match cut(&whole, s.dim, s.blocks, ranks, rank) {
                        Ok(part) => part,
                        Err(p) => {
                            problem.get_or_insert(p);
                            whole
                        }
                    }
                }
                _ => whole,
            }
        });
        if let Some(p) = problem {
            return Err(self.mismatch(&saved.path, format!("its state: {p}")));
        }
        Ok(Some(tree))
    }

    /// An error naming a saved parameter the model did not name ([`Save::locate`]), if any.
    fn unvisited(&self) -> Result<()> {
        match (self.seen.iter()).position(|&seen| !seen) {
            Some(i) => Err(self.mismatch(
                &self.manifest.params[i].path,
                "the model has no such parameter".into(),
            )),
            None => Ok(()),
        }
    }
}

/// Checks, cheaply, that the save in `dir` is whole: its manifest reads, and every rank's file it
/// names is there with the size it records (the SHA-256s are checked as each file is read). For
/// choosing among checkpoints before loading one.
pub fn check_sharded_checkpoint(dir: &Path) -> Result<()> {
    let save = Save::open(dir)?;
    for named in &save.manifest.files {
        let path = dir.join(&named.name);
        match std::fs::metadata(&path) {
            Ok(m) if m.len() == named.bytes => {}
            Ok(m) => {
                return Err(ShardedCheckpointError::Incomplete {
                    dir: dir.to_path_buf(),
                    problem: format!(
                        "{} has {} bytes, the manifest says {}",
                        named.name,
                        m.len(),
                        named.bytes
                    ),
                });
            }
            Err(_) => {
                return Err(ShardedCheckpointError::Incomplete {
                    dir: dir.to_path_buf(),
                    problem: format!("{} is missing", named.name),
                });
            }
        }
    }
    Ok(())
}

/// Whether `v` is a serialized `TensorData` (a map of exactly `bytes`, `shape` and `dtype`).
fn is_tensor(v: &ciborium::Value) -> bool {
    let ciborium::Value::Map(entries) = v else {
        return false;
    };
    let mut keys: Vec<&str> = entries.iter().filter_map(|(k, _)| k.as_text()).collect();
    keys.sort_unstable();
    entries.len() == 3 && keys == ["bytes", "dtype", "shape"]
}

/// Every tensor in `v`, in order.
fn tensors(v: &ciborium::Value) -> Vec<TensorData> {
    let mut out = Vec::new();
    walk(v, &mut |t| out.push(t));
    out
}

fn walk(v: &ciborium::Value, f: &mut dyn FnMut(TensorData)) {
    if is_tensor(v) {
        if let Ok(t) = v.deserialized::<TensorData>() {
            f(t);
        }
        return;
    }
    match v {
        ciborium::Value::Array(items) => items.iter().for_each(|i| walk(i, f)),
        ciborium::Value::Map(entries) => entries.iter().for_each(|(_, i)| walk(i, f)),
        ciborium::Value::Tag(_, inner) => walk(inner, f),
        _ => {}
    }
}

/// Replaces every tensor in `v` (in the order of [`tensors`]) by `f` of it.
fn map_tensors(v: &mut ciborium::Value, f: &mut dyn FnMut(TensorData) -> TensorData) {
    if is_tensor(v) {
        if let Ok(t) = v.deserialized::<TensorData>()
            && let Ok(new) = ciborium::Value::serialized(&f(t))
        {
            *v = new;
        }
        return;
    }
    match v {
        ciborium::Value::Array(items) => items.iter_mut().for_each(|i| map_tensors(i, f)),
        ciborium::Value::Map(entries) => entries.iter_mut().for_each(|(_, i)| map_tensors(i, f)),
        ciborium::Value::Tag(_, inner) => map_tensors(inner, f),
        _ => {}
    }
}

/// The record of the optimizer's state from its item `tree`.
fn record_of<O, B>(
    save: &Save,
    param: &str,
    tree: ciborium::Value,
    device: &B::Device,
) -> Result<AdaptorRecord<O, B>>
where
    O: SimpleOptimizer<B::InnerBackend>,
    B: AutodiffBackend,
{
    let item = tree
        .deserialized::<<AdaptorRecord<O, B> as Record<B>>::Item<FullPrecisionSettings>>()
        .map_err(|e| {
            save.mismatch(
                param,
                format!(
                    "its state is not a state of {} ({e})",
                    std::any::type_name::<O>()
                ),
            )
        })?;
    Ok(AdaptorRecord::from_item(item, device))
}

/// Where a rank of `ranks` holding a tensor placed as `placement` keeps it split: `None` when it
/// is whole (or the rank alone).
fn split_of(placement: Placement, ranks: usize) -> Option<SplitAt> {
    match placement {
        Placement::Shard { dim, blocks } if ranks > 1 => Some(SplitAt { dim, blocks }),
        _ => None,
    }
}

/// Loads the save in `dir` ([`save_sharded_checkpoint`]) into `model` and `optim` on every rank:
/// `model` laid out as it will train (by [`crate::fully_shard`] on the ranks that load it, or
/// whole on one device), `optim` a fresh `Sharded` optimizer, at [`crate::ZeroStage::Three`]
/// for a sharded model. The parameters are matched by module path and keep `model`'s ids (the
/// fully sharded group knows each split by its id).
///
/// On the mesh that wrote the save each rank reads only its own file, and takes its slices as
/// they are: the run continues bit for bit. On another number of ranks, or on one device, every
/// rank reads every rank's file once, one at a time, copying out of each the elements its own
/// slices share with it (of each parameter and each tensor of its state) before it lets the file
/// go: it holds one file and its own slices, never every file (the whole model and state). No
/// communication.
///
/// Errors: no manifest (no complete save); a file missing, changed or from another save (its
/// size or SHA-256 is not the manifest's); a parameter the model lacks, or of another shape; a
/// state that is not this optimizer's; several data-parallel ranks but a model not sharded.
#[allow(clippy::type_complexity)]
pub fn load_sharded_checkpoint<B, M, O>(
    dir: &Path,
    model: M,
    optim: Sharded<OptimizerAdaptor<O, M, B>>,
) -> Result<(M, Sharded<OptimizerAdaptor<O, M, B>>)>
where
    B: AutodiffBackend + TensorParallelBackend,
    M: AutodiffModule<B>,
    O: SimpleOptimizer<B::InnerBackend>,
{
    let device = model.devices().into_iter().next().unwrap_or_default();
    let (rank, ranks, _) = mesh(&device)?;
    let mut save = Save::open(dir)?;
    save.check_optimizer::<O>()?;

    struct Load<'a, O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
        save: &'a mut Save,
        rank: usize,
        ranks: usize,
        path: Vec<String>,
        states: HashMap<ParamId, AdaptorRecord<O, B>>,
        error: Option<ShardedCheckpointError>,
    }
    impl<O, B> Load<'_, O, B>
    where
        O: SimpleOptimizer<B::InnerBackend>,
        B: AutodiffBackend + TensorParallelBackend,
    {
        fn load<const D: usize>(
            &mut self,
            id: ParamId,
            tensor: &Tensor<B, D>,
        ) -> Result<Tensor<B, D>> {
            let name = self.path.join(".");
            let i = self.save.locate(&name, &tensor.shape().to_vec())?;
            let tp = B::tp_part(tensor.clone().into_primitive().tensor());
            let device = tp.device();
            let split = split_of(tp.placement(), self.ranks);
            let data = self.save.value(i, self.rank, self.ranks, split)?;
            let local = <B::Inner as burn_backend::ops::FloatTensorOps<B::Inner>>::float_from_data(
                data, &device,
            );
            let placed = match split {
                Some(s) => TpTensor::local(local, s.placement(), Some(tensor.shape())),
                None => TpTensor::replicated(local),
            };
            let mut t: Tensor<B, D> =
                Tensor::from_primitive(TensorPrimitive::Float(B::from_tp(placed)));
            if tensor.is_require_grad() {
                t = t.require_grad();
            }
            if tensor.is_distributed() {
                t = t.set_distributed(burn_backend::distributed::DistributedParamId::from(
                    id.val(),
                ));
            }
            if let Some(tree) = self.save.state(i, self.rank, self.ranks, split)? {
                let device = tensor.device();
                let record = record_of::<O, B>(self.save, &name, tree, &device)?;
                let state = record.into_state::<D>();
                let placed = super::fsdp::adopt_state(id.val(), || O::to_device(state, &device));
                self.states.insert(id, AdaptorRecord::from_state(placed));
            }
            Ok(t)
        }
    }
    impl<O, B> ModuleMapper<B> for Load<'_, O, B>
    where
        O: SimpleOptimizer<B::InnerBackend>,
        B: AutodiffBackend + TensorParallelBackend,
    {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            if self.error.is_some() {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            match self.load(id, &tensor) {
                Ok(t) => Param::from_mapped_value(id, t, mapper),
                Err(e) => {
                    self.error = Some(e);
                    Param::from_mapped_value(id, tensor, mapper)
                }
            }
        }
    }
    // On another mesh the rank files are read one at a time for this rank's parts, ahead of
    // the loading below.
    let wanted = save.wanted(&model, |t: Option<TensorPrimitive<B>>| {
        // A parameter not drawn yet is drawn whole (`fully_shard` draws what it shards).
        let split = t.and_then(|t| split_of(B::tp_part(t.tensor()).placement(), ranks));
        Part { split, ranks, rank }
    })?;
    save.stream(&wanted, true)?;
    let mut load = Load::<O, B> {
        save: &mut save,
        rank,
        ranks,
        path: Vec::new(),
        states: HashMap::new(),
        error: None,
    };
    let model = model.map(&mut load);
    if let Some(e) = load.error {
        return Err(e);
    }
    let states = load.states;
    save.unvisited()?;
    let optim = optim.map_inner(|o| o.load_record(states.into_iter().collect()));
    Ok((model, optim))
}

/// `model` (on any backend, unsplit) with every parameter set to its whole value from the save
/// in `dir`, matched by module path, under its saved id: a sharded save loaded on one device, for
/// inference (the optimizer's state is not read). Reads every rank's file; no communication.
pub fn consolidate_sharded_model<B, M>(dir: &Path, model: M) -> Result<M>
where
    B: burn::tensor::backend::Backend,
    M: burn::module::Module<B>,
{
    let mut save = Save::open(dir)?;
    whole_model(&mut save, model, false).map(|(model, _)| model)
}

/// `model` with every parameter whole from `save`, each given its saved id; and each parameter's
/// id, index in the save and module path. With `with_state`, each parameter's state is put
/// together whole too, for [`Save::state`] to take.
#[allow(clippy::type_complexity)]
fn whole_model<B, M>(
    save: &mut Save,
    model: M,
    with_state: bool,
) -> Result<(M, Vec<(ParamId, usize, String)>)>
where
    B: burn::tensor::backend::Backend,
    M: burn::module::Module<B>,
{
    struct Whole<'a> {
        save: &'a mut Save,
        params: Vec<(ParamId, usize, String)>,
        path: Vec<String>,
        error: Option<ShardedCheckpointError>,
    }
    impl Whole<'_> {
        fn load<B: burn::tensor::backend::Backend, const D: usize>(
            &mut self,
            tensor: &Tensor<B, D>,
        ) -> Result<Tensor<B, D>> {
            let name = self.path.join(".");
            let i = self.save.locate(&name, &tensor.shape().to_vec())?;
            let saved_id = ParamId::from(self.save.saved_id(i)?);
            let data = self.save.value(i, 0, 1, None)?;
            let t = Tensor::<B, D>::from_data(data, &tensor.device());
            self.params.push((saved_id, i, name));
            Ok(t)
        }
    }
    impl<B: burn::tensor::backend::Backend> ModuleMapper<B> for Whole<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            if self.error.is_some() {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            match self.load(&tensor) {
                Ok(t) => {
                    let t = if tensor.is_require_grad() {
                        t.require_grad()
                    } else {
                        t
                    };
                    // The saved id, as Burn's `load_record` gives a loaded parameter its
                    // record's: the same on every rank that loads the save.
                    let (saved, _, _) = self.params.last().expect("just loaded");
                    Param::from_mapped_value(*saved, t, mapper)
                }
                Err(e) => {
                    self.error = Some(e);
                    Param::from_mapped_value(id, tensor, mapper)
                }
            }
        }
    }
    let wanted = save.wanted(&model, |_| Part::WHOLE)?;
    save.stream(&wanted, with_state)?;
    let mut whole = Whole {
        save,
        params: Vec::new(),
        path: Vec::new(),
        error: None,
    };
    let model = model.map(&mut whole);
    if let Some(e) = whole.error {
        return Err(e);
    }
    let params = whole.params;
    save.unvisited()?;
    Ok((model, params))
}

/// The whole model and the unwrapped optimizer's record from the save in `dir`, on one device
/// and any autodiff backend: every parameter of `model` (matched by module path) set to its whole value
/// under its saved id (as Burn's `load_record` gives a parameter its record's, so every rank
/// that loads it agrees), and each one's optimizer state whole, keyed by those ids. What a sharded save converts
/// to: record both with any Burn recorder (the optimizer's as `InOrder::new(record, &model)` to
/// load under other ids), load the record into Burn's own optimizer with `load_record`, or into
/// a `Sharded` one at stage 1 or 2 with `load_consolidated_record`. Reads every rank's file; no
/// communication.
pub fn consolidate_sharded_checkpoint<B, M, O>(
    dir: &Path,
    model: M,
) -> Result<(M, StateRecord<O, M, B>)>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: SimpleOptimizer<B::InnerBackend>,
{
    let device = model.devices().into_iter().next().unwrap_or_default();
    let mut save = Save::open(dir)?;
    save.check_optimizer::<O>()?;
    let (model, params) = whole_model(&mut save, model, true)?;
    let mut states = StateRecord::<O, M, B>::default();
    for (id, i, name) in params {
        if let Some(tree) = save.state(i, 0, 1, None)? {
            states.insert(id, record_of::<O, B>(&save, &name, tree, &device)?);
        }
    }
    Ok((model, states))
}

/// Writes a save for `ranks` ranks to `dir` from a whole `model` and the unwrapped optimizer's
/// `record` for it (its ids), in one process and on any autodiff backend: each trainable parameter is
/// split along its largest dimension that `ranks` divides, as [`crate::fully_shard`] splits it,
/// and each tensor of its state with the parameter's shape with it; the rest stay whole. The
/// result loads with [`load_sharded_checkpoint`] on `ranks` ranks as if they had saved it.
/// Returns the files written. `dir` must not hold a save already.
pub fn shard_checkpoint<B, M, O>(
    dir: &Path,
    model: &M,
    record: StateRecord<O, M, B>,
    ranks: usize,
) -> Result<Vec<PathBuf>>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: SimpleOptimizer<B::InnerBackend>,
{
    assert!(ranks >= 1, "a save is for one rank or more");
    if dir.join(MANIFEST).exists() {
        return Err(ShardedCheckpointError::Exists {
            dir: dir.to_path_buf(),
        });
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    /// Each parameter whole, its split for `ranks`, and its state's item.
    struct Collect<O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
        ranks: usize,
        path: Vec<String>,
        states: HashMap<ParamId, AdaptorRecord<O, B>>,
        params: Vec<(ParamPart, Option<ciborium::Value>)>,
        error: Option<String>,
    }
    impl<O, B> ModuleVisitor<B> for Collect<O, B>
    where
        O: SimpleOptimizer<B::InnerBackend>,
        B: AutodiffBackend,
    {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self.path.join(".");
            let value = param.val();
            let shape = value.dims().to_vec();
            let split = super::fsdp::shard_dim(&shape, self.ranks)
                .filter(|_| self.ranks > 1 && value.is_require_grad())
                .map(|dim| SplitAt { dim, blocks: 1 });
            let data = value.into_data();
            let state = self.states.remove(&param.id).and_then(|record| {
                let item = record.into_item::<FullPrecisionSettings>();
                ciborium::Value::serialized(&item)
                    .map_err(|e| {
                        self.error
                            .get_or_insert(format!("encoding the state of {path}: {e}"));
                    })
                    .ok()
            });
            self.params.push((
                ParamPart {
                    path,
                    id: param.id.val(),
                    shape,
                    split,
                    data,
                    state: None,
                },
                state,
            ));
        }
    }
    let mut collect = Collect::<O, B> {
        ranks,
        path: Vec::new(),
        states: record.into_iter().collect(),
        params: Vec::new(),
        error: None,
    };
    model.visit(&mut collect);
    let format = |reason: String| ShardedCheckpointError::Format {
        path: dir.to_path_buf(),
        reason,
    };
    if let Some(reason) = collect.error {
        return Err(format(reason));
    }
    if !collect.states.is_empty() {
        return Err(format(format!(
            "the optimizer's record has state for {} parameter id(s) that `model` does not have \
             (a record keyed by another model's ids: load it into this model's optimizer first)",
            collect.states.len()
        )));
    }
    let mut files = Vec::with_capacity(ranks);
    let mut written = Vec::with_capacity(ranks);
    let mut first = None;
    for rank in 0..ranks {
        let mut params = Vec::with_capacity(collect.params.len());
        for (whole, state) in &collect.params {
            let mut part = whole.clone();
            if let Some(s) = whole.split {
                part.data = cut(&whole.data, s.dim, s.blocks, ranks, rank).map_err(&format)?;
            }
            if let Some(tree) = state {
                let mut tree = tree.clone();
                let mut problem = None;
                map_tensors(&mut tree, &mut |t| match whole.split {
                    Some(s) if t.shape.to_vec() == whole.shape => {
                        cut(&t, s.dim, s.blocks, ranks, rank).unwrap_or_else(|p| {
                            problem.get_or_insert(p);
                            t
                        })
                    }
                    _ => t,
                });
                if let Some(p) = problem {
                    return Err(format(format!("the state of {}: {p}", whole.path)));
                }
                part.state = Some(encode_item(&tree).map_err(&format)?);
            }
            params.push(part);
        }
        let file = RankFile {
            magic: MAGIC.into(),
            rank,
            ranks,
            params,
        };
        files.push(write_rank_file(dir, &file)?);
        written.push(dir.join(rank_file_name(rank, ranks)));
        if rank == 0 {
            first = Some(file);
        }
    }
    let first = first.expect("one rank or more");
    let manifest = manifest_of(ranks, std::any::type_name::<O>(), listed(&first), files);
    write_manifest(dir, &manifest, 0)?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way a part can be laid out over `shape`: whole, and each dimension in 1 or 2
    /// blocks over 1 to 4 ranks, where they divide it.
    fn layouts(shape: &[usize]) -> Vec<(Option<SplitAt>, usize)> {
        let mut out = vec![(None, 1)];
        for (dim, &size) in shape.iter().enumerate() {
            for blocks in [1, 2] {
                for ranks in 1..=4 {
                    if size.is_multiple_of(blocks * ranks) {
                        out.push((Some(SplitAt { dim, blocks }), ranks));
                    }
                }
            }
        }
        out
    }

    fn counting(shape: &[usize]) -> TensorData {
        let n: usize = shape.iter().product();
        TensorData::new(
            (0..n).map(|v| v as f32).collect::<Vec<f32>>(),
            shape.to_vec(),
        )
    }

    /// Rank `rank`'s part of `whole` as `split` over `ranks` lays it out (the oracle: `cut`).
    fn oracle(whole: &TensorData, split: Option<SplitAt>, ranks: usize, rank: usize) -> TensorData {
        match split {
            Some(s) => cut(whole, s.dim, s.blocks, ranks, rank).unwrap(),
            None => whole.clone(),
        }
    }

    /// A new rank's part put together from the saved ranks' parts by `copy_overlap`, one saved
    /// part at a time, equals cutting the whole tensor for it, for every saved layout and every
    /// new one of three shapes.
    #[test]
    fn parts_put_together_from_overlaps_equal_the_whole_cut_again() {
        for shape in [vec![12], vec![4, 6], vec![2, 6, 4]] {
            let whole = counting(&shape);
            for (saved, n) in layouts(&shape) {
                let parts: Vec<TensorData> = (0..n).map(|r| oracle(&whole, saved, n, r)).collect();
                for (split, ranks) in layouts(&shape) {
                    for rank in 0..ranks {
                        let into = Part { split, ranks, rank };
                        let want = oracle(&whole, split, ranks, rank);
                        let mut got = vec![0u8; want.as_bytes().len()];
                        for (r, part) in parts.iter().enumerate() {
                            let of = Part {
                                split: saved,
                                ranks: n,
                                rank: r,
                            };
                            copy_overlap(&shape, 4, part.as_bytes(), of, &mut got, into);
                        }
                        assert_eq!(
                            got,
                            want.as_bytes(),
                            "{shape:?} saved {saved:?} over {n}, loaded {split:?} over {ranks}, \
                             rank {rank}"
                        );
                    }
                }
            }
        }
    }

    /// A state's record item as a test writes it: one moment with the parameter's slice's shape
    /// and a step count.
    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Moment {
        step: usize,
        moment: TensorData,
        /// Whole on every rank, of the parameter's whole shape (as AMSGrad's maximum is).
        most: TensorData,
    }

    /// The whole-kept tensor of a parameter of `shape`'s test state.
    fn most(shape: &[usize]) -> TensorData {
        let n: usize = shape.iter().product();
        TensorData::new(
            (0..n).map(|v| 100.0 + v as f32).collect::<Vec<f32>>(),
            shape.to_vec(),
        )
    }

    /// A save of `n` ranks of two parameters (one split along dimension 1 in 2 blocks, one
    /// whole), each with a state, written as `save_sharded_checkpoint` writes one; and the
    /// split one's whole value.
    fn fake_save(dir: &Path, n: usize) -> TensorData {
        let shape = vec![3, 8];
        let whole = counting(&shape);
        let split = SplitAt { dim: 1, blocks: 2 };
        let bias = counting(&[5]);
        let mut files = Vec::new();
        let mut first = None;
        for rank in 0..n {
            let slice = cut(&whole, 1, 2, n, rank).unwrap();
            let state = |t: &TensorData, whole: &[usize]| {
                let moment = TensorData::new(
                    t.to_vec::<f32>().unwrap().iter().map(|v| v * 0.5).collect(),
                    t.shape.clone(),
                );
                let most = most(whole);
                Some(
                    encode_item(&Moment {
                        step: 3,
                        moment,
                        most,
                    })
                    .unwrap(),
                )
            };
            let params = vec![
                ParamPart {
                    path: "w".into(),
                    id: 7,
                    shape: shape.clone(),
                    split: Some(split),
                    state: state(&slice, &shape),
                    data: slice,
                },
                ParamPart {
                    path: "b".into(),
                    id: 9,
                    shape: vec![5],
                    split: None,
                    state: state(&bias, &[5]),
                    data: bias.clone(),
                },
            ];
            let file = RankFile {
                magic: MAGIC.into(),
                rank,
                ranks: n,
                params,
            };
            files.push(write_rank_file(dir, &file).unwrap());
            first.get_or_insert(file);
        }
        let manifest = manifest_of(n, "test", listed(&first.unwrap()), files);
        write_manifest(dir, &manifest, 0).unwrap();
        whole
    }

    /// Loading a save of 4 ranks at 3 (and on one device) holds one rank file at a time, where
    /// reading the parts on demand held all 4; both give the same parts and states.
    #[test]
    fn a_load_at_another_mesh_holds_one_rank_file_at_a_time() {
        let dir = std::env::temp_dir().join(format!("bonfire-stream-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let whole = fake_save(&dir, 4);
        let (w, b) = (0, 1);
        for (split, ranks) in [(Some(SplitAt { dim: 0, blocks: 1 }), 3), (None, 1)] {
            for rank in 0..ranks {
                let into = Part { split, ranks, rank };
                let mut streamed = Save::open(&dir).unwrap();
                let wanted = vec![
                    Want {
                        index: w,
                        part: into,
                    },
                    Want {
                        index: b,
                        part: Part::WHOLE,
                    },
                ];
                streamed.stream(&wanted, true).unwrap();
                let mut on_demand = Save::open(&dir).unwrap();
                for save in [&mut streamed, &mut on_demand] {
                    let value = save.value(w, rank, ranks, split).unwrap();
                    assert_eq!(value, oracle(&whole, split, ranks, rank));
                    let state = save.state(w, rank, ranks, split).unwrap().unwrap();
                    let state: Moment = state.deserialized().unwrap();
                    assert_eq!(state.step, 3);
                    let half = TensorData::new(
                        value
                            .to_vec::<f32>()
                            .unwrap()
                            .iter()
                            .map(|v| v * 0.5)
                            .collect(),
                        value.shape.clone(),
                    );
                    assert_eq!(state.moment, half);
                    assert_eq!(state.most, oracle(&most(&[3, 8]), split, ranks, rank));
                    assert_eq!(save.value(b, 0, 1, None).unwrap(), counting(&[5]));
                    assert_eq!(save.saved_id(w).unwrap(), 7);
                }
                assert_eq!(streamed.held_most, 1, "{split:?} over {ranks}");
                assert_eq!(on_demand.held_most, 4, "{split:?} over {ranks}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sums_travel_as_four_words() {
        let sum = hex(&sha256(b"bonfire"));
        assert_eq!(words_hex(&u8_words(&sum)), sum);
    }

    #[test]
    fn tensors_in_a_record_tree_are_found_and_replaced_in_order() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct State {
            time: usize,
            flag: bool,
            first: TensorData,
            rest: Option<Vec<TensorData>>,
        }
        let t = |v: Vec<f32>| {
            let n = v.len();
            TensorData::new(v, [n])
        };
        let state = State {
            time: 7,
            flag: true,
            first: t(vec![1.0, 2.0]),
            rest: Some(vec![t(vec![3.0]), t(vec![4.0, 5.0, 6.0])]),
        };
        let mut tree = ciborium::Value::serialized(&state).unwrap();
        let found = tensors(&tree);
        assert_eq!(
            found,
            vec![t(vec![1.0, 2.0]), t(vec![3.0]), t(vec![4.0, 5.0, 6.0])]
        );
        map_tensors(&mut tree, &mut |d| {
            let v: Vec<f32> = d.to_vec().unwrap();
            t(v.iter().map(|x| x * 10.0).collect())
        });
        let back: State = tree.deserialized().unwrap();
        assert_eq!(
            back,
            State {
                time: 7,
                flag: true,
                first: t(vec![10.0, 20.0]),
                rest: Some(vec![t(vec![30.0]), t(vec![40.0, 50.0, 60.0])]),
            }
        );
    }
}
