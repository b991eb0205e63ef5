//! A shared-memory segment: a file under the shared-memory directory (`/dev/shm`), created
//! owner-only with a name nobody can guess, mapped by its two ranks and unlinked as soon as both
//! have mapped it.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A mapped segment. Unmapped on drop; the file is removed by [`Segment::unlink`].
pub(crate) struct Segment {
    ptr: *mut u8,
    len: usize,
    path: PathBuf,
}

// SAFETY: the mapping is plain shared memory; every access to its contents goes through atomics
// or through the ring's single-producer, single-consumer protocol.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

/// Why a segment could not be made or mapped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SegmentError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a private segment of this user ({why})")]
    NotPrivate { path: PathBuf, why: String },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SegmentError + 'a {
    move |source| SegmentError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

fn c_path(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

fn check(r: libc::c_int) -> std::io::Result<libc::c_int> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl Segment {
    /// Creates `path` (which must not exist), owner-only, with `len` bytes reserved in memory
    /// (so a full `/dev/shm` fails here, not later with a bus error), and maps it.
    pub(crate) fn create(path: &Path, len: usize) -> Result<Segment, SegmentError> {
        let c = c_path(path).map_err(io("naming", path))?;
        // SAFETY: a valid C string; the call creates a new file or fails.
        let fd = check(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        })
        .map_err(io("creating", path))?;
        // SAFETY: a descriptor we just opened and own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let reserve = || -> std::io::Result<()> {
            let size = libc::off_t::try_from(len)
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
            // SAFETY: a valid descriptor.
            let r = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, size) };
            match r {
                0 => Ok(()),
                libc::EOPNOTSUPP | libc::EINVAL => {
                    // SAFETY: a valid descriptor.
                    check(unsafe { libc::ftruncate(fd.as_raw_fd(), size) }).map(drop)
                }
                e => Err(std::io::Error::from_raw_os_error(e)),
            }
        };
        if let Err(e) = reserve() {
            let _ = std::fs::remove_file(path);
            return Err(io("reserving memory for", path)(e));
        }
        match Segment::map(&fd, len, path) {
            Ok(s) => Ok(s),
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(e)
            }
        }
    }

    /// Maps an existing segment of exactly `len` bytes, if it is a regular file owned by this
    /// user that nobody else may read or write.
    pub(crate) fn open(path: &Path, len: usize) -> Result<Segment, SegmentError> {
        let c = c_path(path).map_err(io("naming", path))?;
        // SAFETY: a valid C string.
        let fd = check(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        })
        .map_err(io("opening", path))?;
        // SAFETY: a descriptor we just opened and own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero stat is a valid value to be overwritten.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a valid stat buffer.
        check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }).map_err(io("inspecting", path))?;
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        let not_private = |why: String| SegmentError::NotPrivate {
            path: path.to_path_buf(),
            why,
        };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(not_private("not a regular file".into()));
        }
        if st.st_uid != me {
            return Err(not_private(format!("owned by uid {}", st.st_uid)));
        }
        if st.st_mode & 0o077 != 0 {
            return Err(not_private(format!("mode {:o}", st.st_mode & 0o777)));
        }
        if u64::try_from(st.st_size).ok() != Some(len as u64) {
            return Err(not_private(format!("{} bytes, not {len}", st.st_size)));
        }
        Segment::map(&fd, len, path)
    }

    fn map(fd: &OwnedFd, len: usize, path: &Path) -> Result<Segment, SegmentError> {
        // SAFETY: maps `len` bytes of a file at least that long; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io("mapping", path)(std::io::Error::last_os_error()));
        }
        Ok(Segment {
            ptr: ptr.cast(),
            len,
            path: path.to_path_buf(),
        })
    }

    /// Removes the file; the mappings stay valid until both sides drop them.
    pub(crate) fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// The start of the mapping (page-aligned).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The length of the mapping.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; nothing uses it after the drop.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn segments_are_private_and_shared_between_mappings() {
        let dir = std::env::temp_dir().join(format!("bonfire-seg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let _ = std::fs::remove_file(&path);
        let a = Segment::create(&path, 8192).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(Segment::create(&path, 8192).is_err(), "never reuses a file");
        let b = Segment::open(&path, 8192).unwrap();
        // SAFETY: both mappings are 8192 bytes long.
        unsafe {
            *a.ptr().add(100) = 42;
            assert_eq!(*b.ptr().add(100), 42);
        }
        assert!(
            Segment::open(&path, 4096).is_err(),
            "the size must be the one announced"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Segment::open(&path, 8192).err().unwrap();
        assert!(err.to_string().contains("mode 644"), "{err}");
        a.unlink();
        assert!(!path.exists());
        // SAFETY: still mapped after the unlink.
        unsafe { assert_eq!(*b.ptr().add(100), 42) };
        let _ = std::fs::remove_dir_all(&dir);
    }
}
