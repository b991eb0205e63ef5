//! The IDX format of the MNIST files: a big-endian magic number (`0x0000_08_NN`, unsigned bytes,
//! NN dimensions), NN big-endian u32 sizes, then the bytes. Only a range of the first dimension is
//! read, so a rank reads only its shard.

use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::Path;

use crate::DataError;

/// An IDX file's sizes, and the part of its first dimension that was read.
#[derive(Debug)]
pub(crate) struct Idx {
    /// All dimensions, the first one whole.
    pub(crate) dims: Vec<usize>,
    /// The items read (rows of the first dimension), each `item_len` bytes.
    pub(crate) bytes: Vec<u8>,
}

/// Reads items `range` (all when `None`) of an IDX file with `ndims` dimensions of unsigned bytes.
pub(crate) fn read<R: Read + Seek>(
    mut r: R,
    path: &Path,
    ndims: u8,
    range: impl FnOnce(usize) -> Result<Range<usize>, DataError>,
) -> Result<Idx, DataError> {
    let malformed = |why: String| DataError::Malformed {
        path: path.to_owned(),
        why,
    };
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)
        .map_err(|_| malformed("shorter than an IDX header".into()))?;
    if magic[..3] != [0, 0, 0x08] || magic[3] != ndims {
        return Err(malformed(format!(
            "not an IDX file of {ndims}-dimensional unsigned bytes (magic {magic:02x?}); \
             is it still gzipped?"
        )));
    }
    let mut dims = Vec::new();
    for _ in 0..ndims {
        let mut d = [0u8; 4];
        r.read_exact(&mut d)
            .map_err(|_| malformed("header cut short".into()))?;
        dims.push(u32::from_be_bytes(d) as usize);
    }
    let item: usize = dims[1..].iter().product();
    let range = range(dims[0])?;
    let header = 4 + 4 * ndims as u64;
    r.seek(SeekFrom::Start(header + (range.start * item) as u64))
        .map_err(DataError::io(path))?;
    let mut bytes = vec![0u8; range.len() * item];
    r.read_exact(&mut bytes).map_err(|_| {
        malformed(format!(
            "holds fewer than the {} items its header promises",
            dims[0]
        ))
    })?;
    Ok(Idx { dims, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn file(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut v = vec![0, 0, 8, dims.len() as u8];
        for d in dims {
            v.extend_from_slice(&d.to_be_bytes());
        }
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn reads_a_range_of_items() {
        let data: Vec<u8> = (0..24).collect();
        let f = file(&[4, 2, 3], &data);
        let idx = read(Cursor::new(f), Path::new("x"), 3, |n| Ok(1..3.min(n))).unwrap();
        assert_eq!(idx.dims, vec![4, 2, 3]);
        assert_eq!(idx.bytes, (6..18).collect::<Vec<u8>>());
    }

    #[test]
    fn bad_files_are_named() {
        let gz = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0];
        let e = read(Cursor::new(gz), Path::new("t.gz"), 1, |n| Ok(0..n)).unwrap_err();
        assert!(
            e.to_string().contains("t.gz") && e.to_string().contains("gzipped"),
            "{e}"
        );
        let short = file(&[5], &[1, 2]);
        let e = read(Cursor::new(short), Path::new("l"), 1, |n| Ok(0..n)).unwrap_err();
        assert!(e.to_string().contains("fewer than the 5 items"), "{e}");
    }
}
