//! Saving and loading a tensor-parallel model: every rank its own part ([`save_shards`],
//! [`load_shards`]), or the whole model as a plain single-device record ([`gathered`], then any
//! Burn recorder; load a plain record with `load_record` and split it again with
//! [`crate::tensor_parallel()`]).

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::backend::TensorParallelBackend;
use super::placement::{Placement, local_shape};
use super::redistribute::{Why, group, local_of, whole};
use super::tensor::TpTensor;

/// Why a checkpoint could not be saved or loaded.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// The file could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a shard checkpoint (or is damaged).
    #[error("{path}: not a tensor-parallel shard checkpoint: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What did not parse.
        reason: String,
    },
    /// The checkpoint was written by another rank or group size.
    #[error(
        "{path} holds rank {file_rank} of a group of {file_ranks}, but this is rank {rank} of {ranks}"
    )]
    OtherGroup {
        /// The file.
        path: PathBuf,
        /// The rank that wrote it.
        file_rank: usize,
        /// Its group's size.
        file_ranks: usize,
        /// This rank.
        rank: usize,
        /// This group's size.
        ranks: usize,
    },
    /// The model does not have the checkpoint's parameters.
    #[error("{path}: parameter {param}: {problem}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// The parameter.
        param: String,
        /// How it differs.
        problem: String,
    },
}

#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
enum PlacementRecord {
    Replicate,
    Shard { dim: usize, blocks: usize },
}

#[derive(Serialize, Deserialize)]
struct Entry {
    path: String,
    shape: Vec<usize>,
    placement: PlacementRecord,
    data: TensorData,
}

#[derive(Serialize, Deserialize)]
struct ShardFile {
    magic: String,
    rank: usize,
    ranks: usize,
    entries: Vec<Entry>,
}

const MAGIC: &str = "bonfire tensor-parallel shards v2";
/// Files of this version carry no checksum; they load unchecked.
const MAGIC_V1: &str = "bonfire tensor-parallel shards v1";
/// Bytes of the SHA-256 that ends a file.
const SUM_LEN: usize = 32;

fn sha256(bytes: &[u8]) -> [u8; SUM_LEN] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// The shard file in `bytes`: its SHA-256 (the last 32 bytes) checked, or a file of the first
/// version, which has none.
fn decode(path: &Path, bytes: &[u8]) -> Result<ShardFile, CheckpointError> {
    let format = |reason: String| CheckpointError::Format {
        path: path.to_path_buf(),
        reason,
    };
    if let Some((body, sum)) = bytes.split_last_chunk::<SUM_LEN>()
        && sha256(body) == *sum
    {
        let file: ShardFile = postcard::from_bytes(body).map_err(|e| format(e.to_string()))?;
        return match file.magic.as_str() {
            MAGIC => Ok(file),
            other => Err(format(format!("it starts with {other:?}"))),
        };
    }
    match postcard::from_bytes::<ShardFile>(bytes) {
        Ok(file) if file.magic == MAGIC_V1 => Ok(file),
        _ => Err(format(format!(
            "it does not match its checksum ({} bytes: changed or cut short since it was written)",
            bytes.len()
        ))),
    }
}

/// The file rank `rank` of `ranks` writes in `dir`.
pub fn shard_file(dir: &Path, rank: usize, ranks: usize) -> PathBuf {
    dir.join(format!("tp-rank{rank}-of-{ranks}.bin"))
}

fn rank_and_ranks() -> (usize, usize) {
    group().map_or((0, 1), |g| (g.rank(), g.size()))
}

/// Writes this rank's part of every parameter of `model` (no communication) to
/// `dir/tp-rank<r>-of-<n>.bin`, atomically (a temporary file renamed into place), and returns
/// the file's path. Every rank of the group writes its own file.
pub fn save_shards<B, M>(model: &M, dir: &Path) -> Result<PathBuf, CheckpointError>
where
    B: TensorParallelBackend,
    M: Module<B>,
{
    struct Collect<B> {
        path: Vec<String>,
        entries: Vec<Entry>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: TensorParallelBackend> ModuleVisitor<B> for Collect<B> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let tp = B::tp_part(param.val().into_primitive().tensor());
            let shape = tp.shape.to_vec();
            let placement = match tp.placement() {
                Placement::Shard { dim, blocks } => PlacementRecord::Shard { dim, blocks },
                // A `Partial` parameter is summed first (no plan makes one).
                _ => PlacementRecord::Replicate,
            };
            let local = match placement {
                PlacementRecord::Replicate => whole::<B::Inner>(tp, Why::Read),
                PlacementRecord::Shard { .. } => local_of::<B::Inner>(tp),
            };
            let data =
                futures::executor::block_on(<B::Inner as burn_backend::ops::FloatTensorOps<
                    B::Inner,
                >>::float_into_data(local))
                .expect("a parameter can be read to the host");
            self.entries.push(Entry {
                path: self.path.join("."),
                shape,
                placement,
                data,
            });
        }
    }
    let mut c = Collect::<B> {
        path: Vec::new(),
        entries: Vec::new(),
        _b: std::marker::PhantomData,
    };
    model.visit(&mut c);
    let (rank, ranks) = rank_and_ranks();
    let file = ShardFile {
        magic: MAGIC.into(),
        rank,
        ranks,
        entries: c.entries,
    };
    let bytes = postcard::to_stdvec(&file).map_err(|e| CheckpointError::Format {
        path: dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    let path = shard_file(dir, rank, ranks);
    let io = |source| CheckpointError::Io {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = path.with_extension("bin.tmp");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.write_all(&sha256(&bytes)).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(path)
}

/// Replaces every parameter of `model` with this rank's part from `dir` (written by
/// [`save_shards`] from a model of the same structure, by the same rank of a group of the same
/// size). No communication. The parameters keep the placements they were saved with.
pub fn load_shards<B, M>(model: M, dir: &Path) -> Result<M, CheckpointError>
where
    B: TensorParallelBackend,
    M: Module<B>,
{
    let (rank, ranks) = rank_and_ranks();
    let path = shard_file(dir, rank, ranks);
    let bytes = std::fs::read(&path).map_err(|source| CheckpointError::Io {
        path: path.clone(),
        source,
    })?;
    let file = decode(&path, &bytes)?;
    if (file.rank, file.ranks) != (rank, ranks) {
        return Err(CheckpointError::OtherGroup {
            path,
            file_rank: file.rank,
            file_ranks: file.ranks,
            rank,
            ranks,
        });
    }
    struct Restore {
        path: Vec<String>,
        file: PathBuf,
        entries: std::vec::IntoIter<Entry>,
        ranks: usize,
        error: Option<CheckpointError>,
    }
    impl<B: TensorParallelBackend> ModuleMapper<B> for Restore {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let name = self.path.join(".");
            let mismatch = |problem: String| CheckpointError::Mismatch {
                path: self.file.clone(),
                param: name.clone(),
                problem,
            };
            let Some(entry) = self.entries.next() else {
                self.error
                    .get_or_insert(mismatch("the checkpoint has no more parameters".into()));
                return Param::from_mapped_value(id, tensor, mapper);
            };
            let shape = tensor.shape();
            let problem = if entry.path != name {
                Some(format!("the checkpoint has {} here", entry.path))
            } else if entry.shape != shape.to_vec() {
                Some(format!(
                    "shape {:?} in the checkpoint, {:?} in the model",
                    entry.shape,
                    shape.to_vec()
                ))
            } else {
                None
            };
            if let Some(p) = problem {
                self.error.get_or_insert(mismatch(p));
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let placement = match entry.placement {
                PlacementRecord::Replicate => Placement::Replicate,
                PlacementRecord::Shard { dim, blocks } => Placement::Shard { dim, blocks },
            };
            if entry.data.shape.to_vec() != local_shape(&shape, placement, self.ranks).to_vec() {
                self.error.get_or_insert(mismatch(format!(
                    "its part has shape {:?}",
                    entry.data.shape
                )));
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let require_grad = tensor.is_require_grad();
            let device = B::tp_part(tensor.clone().into_primitive().tensor()).device();
            let local = <B::Inner as burn_backend::ops::FloatTensorOps<B::Inner>>::float_from_data(
                entry.data, &device,
            );
            let tp = TpTensor::local(local, placement, Some(shape));
            let t = Tensor::from_primitive(TensorPrimitive::Float(B::from_tp(tp)));
            let t = if require_grad { t.require_grad() } else { t };
            Param::from_mapped_value(id, t, mapper)
        }
    }
    let mut restore = Restore {
        path: Vec::new(),
        file: path.clone(),
        entries: file.entries.into_iter(),
        ranks,
        error: None,
    };
    let model = model.map(&mut restore);
    if let Some(e) = restore.error {
        return Err(e);
    }
    if let Some(extra) = restore.entries.next() {
        return Err(CheckpointError::Mismatch {
            path,
            param: extra.path,
            problem: "the model has no such parameter".into(),
        });
    }
    Ok(model)
}

/// `model` with every parameter whole on every rank (split ones gathered): record it with any
/// Burn recorder on rank 0 to get a plain single-device checkpoint. Collective: every rank of the
/// group calls it.
pub fn gathered<B, M>(model: M) -> M
where
    B: TensorParallelBackend,
    M: Module<B>,
{
    struct Gather;
    impl<B: TensorParallelBackend> ModuleMapper<B> for Gather {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let require_grad = tensor.is_require_grad();
            let tp = B::tp_part(tensor.into_primitive().tensor());
            let full = TpTensor::replicated(whole::<B::Inner>(tp, Why::Read));
            let t = Tensor::from_primitive(TensorPrimitive::Float(B::from_tp(full)));
            let t = if require_grad { t.require_grad() } else { t };
            Param::from_mapped_value(id, t, mapper)
        }
    }
    model.map(&mut Gather)
}
