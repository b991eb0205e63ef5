//! Saving and loading a tensor-parallel model: every rank its own part ([`save_shards`],
//! [`load_shards`], which also loads a save made by a group of another size, and
//! [`load_whole`], which loads one into the unsplit model on any backend), or the whole model as
//! a plain single-device record ([`gathered`], then any Burn recorder; load a plain record with
//! `load_record` and split it again with [`crate::tensor_parallel()`]).

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::backend::TensorParallelBackend;
use super::placement::{Placement, local_shape, owned_ranges};
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
    /// The directory holds no complete save to load from (or several of different sizes).
    #[error("{dir}: {problem}")]
    NoSave {
        /// The directory.
        dir: PathBuf,
        /// What it holds instead.
        problem: String,
    },
    /// The files of one save do not agree on a parameter (they are not one save).
    #[error("{dir}: parameter {param}: {problem}")]
    Inconsistent {
        /// The directory.
        dir: PathBuf,
        /// The parameter.
        param: String,
        /// How the files differ.
        problem: String,
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

/// Replaces every parameter of `model` with this rank's part from `dir`, written by
/// [`save_shards`] from a model of the same structure. A save by a group of this size is read
/// from this rank's own file; a save by a group of another size (all its files in `dir`) is
/// read whole, each split parameter put together and cut again for this group (it must divide
/// by this group's size), so a model saved at tensor-parallel size 2 loads at 4, or at 1. No
/// communication. The parameters keep the placements they were saved with.
pub fn load_shards<B, M>(model: M, dir: &Path) -> Result<M, CheckpointError>
where
    B: TensorParallelBackend,
    M: Module<B>,
{
    let (rank, ranks) = rank_and_ranks();
    let own = shard_file(dir, rank, ranks);
    if own.exists() {
        let entries = read_file(&own, rank, ranks)?.entries;
        return apply(model, entries, &own, Local { ranks });
    }
    let set = read_set(dir)?;
    let entries = (0..set[0].entries.len())
        .map(|i| {
            let mut entry = whole_entry(dir, &set, i)?;
            if let PlacementRecord::Shard { dim, blocks } = entry.placement {
                entry.data = cut(&entry.data, dim, blocks, ranks, rank).map_err(|problem| {
                    CheckpointError::Mismatch {
                        path: dir.to_path_buf(),
                        param: entry.path.clone(),
                        problem,
                    }
                })?;
            }
            Ok(entry)
        })
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    apply(model, entries, dir, Local { ranks })
}

/// Shard file `path`, its checksum checked, and checked to hold rank `rank` of a group of
/// `ranks`, as its name says.
fn read_file(path: &Path, rank: usize, ranks: usize) -> Result<ShardFile, CheckpointError> {
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file = decode(path, &bytes)?;
    if (file.rank, file.ranks) != (rank, ranks) {
        return Err(CheckpointError::OtherGroup {
            path: path.to_path_buf(),
            file_rank: file.rank,
            file_ranks: file.ranks,
            rank,
            ranks,
        });
    }
    Ok(file)
}

/// The group size and rank of a shard file's name, `tp-rank<r>-of-<n>.bin`.
fn parse_name(name: &str) -> Option<(usize, usize)> {
    let (r, n) = name
        .strip_prefix("tp-rank")?
        .strip_suffix(".bin")?
        .split_once("-of-")?;
    let number = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let (r, n): (usize, usize) = (number(r)?, number(n)?);
    (r < n).then_some((r, n))
}

/// Every file of the one complete save in `dir` (`tp-rank<r>-of-<n>.bin` for each `r < n`), in
/// rank order, each checked against its sum and its name.
fn read_set(dir: &Path) -> Result<Vec<ShardFile>, CheckpointError> {
    let no_save = |problem: String| CheckpointError::NoSave {
        dir: dir.to_path_buf(),
        problem,
    };
    let listing = std::fs::read_dir(dir).map_err(|source| CheckpointError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut sets: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for entry in listing.flatten() {
        if let Some((r, n)) = entry.file_name().to_str().and_then(parse_name) {
            sets.entry(n).or_default().push(r);
        }
    }
    let describe = |sets: &std::collections::BTreeMap<usize, Vec<usize>>| {
        sets.iter()
            .map(|(n, rs)| format!("{} of the {n} files of a group of {n}", rs.len()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let complete: Vec<usize> = sets
        .iter()
        .filter(|(n, rs)| rs.len() == **n)
        .map(|(n, _)| *n)
        .collect();
    let n = match complete.as_slice() {
        [n] => *n,
        [] if sets.is_empty() => {
            return Err(no_save(
                "no shard files (tp-rank<r>-of-<n>.bin) in it".into(),
            ));
        }
        [] => {
            return Err(no_save(format!(
                "no complete save: it holds {} (every rank's file is needed)",
                describe(&sets)
            )));
        }
        _ => {
            return Err(no_save(format!(
                "saves of groups of {complete:?} ranks side by side: keep one save per directory"
            )));
        }
    };
    (0..n)
        .map(|r| read_file(&shard_file(dir, r, n), r, n))
        .collect()
}

/// Entry `i` of a save, its parts put together: its data is the parameter's whole value.
fn whole_entry(dir: &Path, set: &[ShardFile], i: usize) -> Result<Entry, CheckpointError> {
    let first = &set[0].entries[i];
    let inconsistent = |problem: String| CheckpointError::Inconsistent {
        dir: dir.to_path_buf(),
        param: first.path.clone(),
        problem,
    };
    let mut parts = Vec::with_capacity(set.len());
    for (r, file) in set.iter().enumerate() {
        let Some(e) = file.entries.get(i) else {
            return Err(inconsistent(format!(
                "rank {r}'s file has fewer parameters"
            )));
        };
        if e.path != first.path || e.shape != first.shape || e.placement != first.placement {
            return Err(inconsistent(format!(
                "rank {r}'s file has {} {:?} {:?} here, rank 0's {:?} {:?}",
                e.path, e.shape, e.placement, first.shape, first.placement
            )));
        }
        if e.data.dtype != first.data.dtype {
            return Err(inconsistent(format!(
                "rank {r}'s part is {:?}, rank 0's {:?}",
                e.data.dtype, first.data.dtype
            )));
        }
        parts.push(&e.data);
    }
    let whole = match first.placement {
        PlacementRecord::Replicate => first.data.clone(),
        PlacementRecord::Shard { dim, blocks } => {
            join(&parts, &first.shape, dim, blocks).map_err(inconsistent)?
        }
    };
    Ok(Entry {
        path: first.path.clone(),
        shape: first.shape.clone(),
        placement: first.placement,
        data: whole,
    })
}

/// The bytes before, of, and after one index of dimension `dim` of a row-major `shape`: the
/// number of outer rows, the dimension's size, and the bytes of one inner slice.
fn layout(shape: &[usize], dim: usize, elem: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product::<usize>() * elem;
    (outer, shape[dim], inner)
}

/// The whole value of a parameter of `shape`, split along `dim` in `blocks` blocks over
/// `parts.len()` ranks, from each rank's part (in rank order).
pub(crate) fn join(
    parts: &[&TensorData],
    shape: &[usize],
    dim: usize,
    blocks: usize,
) -> Result<TensorData, String> {
    let n = parts.len();
    let dtype = parts[0].dtype;
    let elem = dtype.size();
    if dim >= shape.len() || blocks == 0 || !shape[dim].is_multiple_of(blocks * n) {
        return Err(format!(
            "dimension {dim} of {shape:?} does not split in {blocks} blocks over {n} ranks"
        ));
    }
    let (outer, size, inner) = layout(shape, dim, elem);
    let local = size / n;
    let mut whole = vec![0u8; outer * size * inner];
    for (r, part) in parts.iter().enumerate() {
        let bytes = part.as_bytes();
        if bytes.len() != outer * local * inner {
            return Err(format!(
                "rank {r}'s part has {} bytes, {} expected",
                bytes.len(),
                outer * local * inner
            ));
        }
        let mut from = 0;
        for o in 0..outer {
            for range in owned_ranges(size, blocks, n, r) {
                let at = (o * size + range.start) * inner;
                let len = range.len() * inner;
                whole[at..at + len].copy_from_slice(&bytes[from..from + len]);
                from += len;
            }
        }
    }
    Ok(TensorData::from_bytes_vec(whole, shape.to_vec(), dtype))
}

/// Rank `r`'s part of `whole`, split along `dim` in `blocks` blocks over `n` ranks.
pub(crate) fn cut(
    whole: &TensorData,
    dim: usize,
    blocks: usize,
    n: usize,
    r: usize,
) -> Result<TensorData, String> {
    let shape = whole.shape.to_vec();
    if dim >= shape.len() || blocks == 0 || !shape[dim].is_multiple_of(blocks * n) {
        return Err(format!(
            "dimension {dim} of {shape:?} does not split in {blocks} blocks over {n} ranks"
        ));
    }
    let (outer, size, inner) = layout(&shape, dim, whole.dtype.size());
    let bytes = whole.as_bytes();
    let mut part = Vec::with_capacity(outer * (size / n) * inner);
    for o in 0..outer {
        for range in owned_ranges(size, blocks, n, r) {
            let at = (o * size + range.start) * inner;
            part.extend_from_slice(&bytes[at..at + range.len() * inner]);
        }
    }
    let mut local = shape;
    local[dim] /= n;
    Ok(TensorData::from_bytes_vec(part, local, whole.dtype))
}

/// Replaces every parameter of `model`, an unsplit model on any backend, with its whole value
/// from the save in `dir` (every rank's file of one [`save_shards`], by a group of any size):
/// a tensor-parallel save loads on one device, and any Burn recorder then turns it into a plain
/// record. No communication.
pub fn load_whole<B, M>(model: M, dir: &Path) -> Result<M, CheckpointError>
where
    B: burn::tensor::backend::Backend,
    M: Module<B>,
{
    let set = read_set(dir)?;
    let entries = (0..set[0].entries.len())
        .map(|i| whole_entry(dir, &set, i))
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    apply(model, entries, dir, Whole)
}

/// How a checkpoint's entry becomes a parameter's value, once its name and whole shape have
/// been checked against the model's.
trait Put<B: burn::tensor::backend::Backend> {
    /// The new value of `current` from `entry`, or why it cannot be.
    fn put<const D: usize>(
        &self,
        current: &Tensor<B, D>,
        entry: Entry,
    ) -> Result<Tensor<B, D>, String>;
}

/// An unsplit model: the entry's whole value.
struct Whole;

impl<B: burn::tensor::backend::Backend> Put<B> for Whole {
    fn put<const D: usize>(
        &self,
        current: &Tensor<B, D>,
        entry: Entry,
    ) -> Result<Tensor<B, D>, String> {
        Ok(Tensor::from_data(entry.data, &current.device()))
    }
}

/// A split model: the entry's data is this rank's part of a group of `ranks`, placed as saved.
struct Local {
    ranks: usize,
}

impl<B: TensorParallelBackend> Put<B> for Local {
    fn put<const D: usize>(
        &self,
        current: &Tensor<B, D>,
        entry: Entry,
    ) -> Result<Tensor<B, D>, String> {
        let shape = current.shape();
        let placement = match entry.placement {
            PlacementRecord::Replicate => Placement::Replicate,
            PlacementRecord::Shard { dim, blocks } => Placement::Shard { dim, blocks },
        };
        if entry.data.shape.to_vec() != local_shape(&shape, placement, self.ranks).to_vec() {
            return Err(format!("its part has shape {:?}", entry.data.shape));
        }
        let device = B::tp_part(current.clone().into_primitive().tensor()).device();
        let local = <B::Inner as burn_backend::ops::FloatTensorOps<B::Inner>>::float_from_data(
            entry.data, &device,
        );
        let tp = TpTensor::local(local, placement, Some(shape));
        Ok(Tensor::from_primitive(TensorPrimitive::Float(B::from_tp(
            tp,
        ))))
    }
}

/// `model` with each parameter replaced by its entry (in the module's order) as `put` makes
/// it; `file` names the checkpoint in errors.
fn apply<B, M, P>(model: M, entries: Vec<Entry>, file: &Path, put: P) -> Result<M, CheckpointError>
where
    B: burn::tensor::backend::Backend,
    M: Module<B>,
    P: Put<B>,
{
    struct Apply<P> {
        path: Vec<String>,
        file: PathBuf,
        entries: std::vec::IntoIter<Entry>,
        put: P,
        error: Option<CheckpointError>,
    }
    impl<B: burn::tensor::backend::Backend, P: Put<B>> ModuleMapper<B> for Apply<P> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let name = self.path.join(".");
            let shape = tensor.shape().to_vec();
            let value = match self.entries.next() {
                None => Err("the checkpoint has no more parameters".to_string()),
                Some(e) if e.path != name => Err(format!("the checkpoint has {} here", e.path)),
                Some(e) if e.shape != shape => Err(format!(
                    "shape {:?} in the checkpoint, {shape:?} in the model",
                    e.shape
                )),
                Some(e) => self.put.put(&tensor, e),
            };
            match value {
                Ok(t) => {
                    let t = if tensor.is_require_grad() {
                        t.require_grad()
                    } else {
                        t
                    };
                    Param::from_mapped_value(id, t, mapper)
                }
                Err(problem) => {
                    self.error.get_or_insert(CheckpointError::Mismatch {
                        path: self.file.clone(),
                        param: name,
                        problem,
                    });
                    Param::from_mapped_value(id, tensor, mapper)
                }
            }
        }
    }
    let mut apply = Apply {
        path: Vec::new(),
        file: file.to_path_buf(),
        entries: entries.into_iter(),
        put,
        error: None,
    };
    let model = model.map(&mut apply);
    if let Some(e) = apply.error {
        return Err(e);
    }
    if let Some(extra) = apply.entries.next() {
        return Err(CheckpointError::Mismatch {
            path: file.to_path_buf(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    fn data(shape: &[usize]) -> TensorData {
        let n: usize = shape.iter().product();
        TensorData::new(
            (0..n).map(|i| i as f32).collect::<Vec<f32>>(),
            shape.to_vec(),
        )
    }

    /// Cutting a value for any group size and putting the parts together gives it back, for
    /// every dimension and block count; a part is what `owned_ranges` says the rank holds.
    #[test]
    fn parts_put_together_give_the_whole_back() {
        let whole = data(&[6, 12, 4]);
        for dim in 0..3 {
            for blocks in [1, 2, 3] {
                for n in [1, 2, 4] {
                    let size = whole.shape[dim];
                    if !size.is_multiple_of(blocks * n) {
                        assert!(cut(&whole, dim, blocks, n, 0).is_err());
                        continue;
                    }
                    let parts: Vec<TensorData> = (0..n)
                        .map(|r| cut(&whole, dim, blocks, n, r).unwrap())
                        .collect();
                    let refs: Vec<&TensorData> = parts.iter().collect();
                    let back = join(&refs, &whole.shape.to_vec(), dim, blocks).unwrap();
                    assert_eq!(
                        back.as_bytes(),
                        whole.as_bytes(),
                        "dim {dim} blocks {blocks} n {n}"
                    );
                    assert_eq!(back.dtype, DType::F32);
                }
            }
        }
        // Rank 1 of 2, blocks 3 along dimension 0 of [6, 1]: rows 1, 3 and 5.
        let part = cut(&data(&[6, 1]), 0, 3, 2, 1).unwrap();
        assert_eq!(part.as_slice::<f32>().unwrap(), &[1.0, 3.0, 5.0]);
    }

    #[test]
    fn only_shard_file_names_parse() {
        assert_eq!(parse_name("tp-rank3-of-4.bin"), Some((3, 4)));
        for bad in [
            "tp-rank4-of-4.bin",
            "tp-rank-1-of-4.bin",
            "tp-rank+1-of-4.bin",
            "tp-rank1-of-4.bin.tmp",
            "tp-rank1-of-.bin",
            "rank1-of-4.bin",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }
}
