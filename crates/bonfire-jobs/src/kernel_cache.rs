//! Where CubeCL keeps a GPU job's compiled kernels and autotune verdicts.
//!
//! CubeCL compiles every kernel the first time a process launches it (NVRTC on CUDA, about half a
//! second each on one core) and, with Burn's `autotune` on, times every candidate kernel for each
//! new matmul or convolution shape before its first use. Both results can be kept on disk, but
//! CubeCL's defaults keep the compiled kernels nowhere and the verdicts under the nearest
//! `target/` directory. Before a job opens a GPU, [`place_kernel_caches`] points both at one
//! directory ([`kernel_cache_root`]), so the second run of a job on a machine compiles and tunes
//! nothing it has seen, whichever directory it starts in. A `cubecl.toml` (or a `burn.toml` with
//! a `[cubecl]` table) in the working directory or above it is CubeCL's own configuration and is
//! left to decide instead.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use bonfire::kernels::cubecl::config::cache::CacheConfig;
use bonfire::kernels::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The variable that names the kernel cache's directory.
pub const KERNEL_CACHE_ENV: &str = "BONFIRE_KERNEL_CACHE";

/// The directory of CubeCL's caches: `$BONFIRE_KERNEL_CACHE` when set, else
/// `$XDG_CACHE_HOME/bonfire/kernels`, else `$HOME/.cache/bonfire/kernels`, else
/// `.bonfire-kernels` in the working directory.
pub fn kernel_cache_root() -> PathBuf {
    bonfire_datasets::user_cache_dir(KERNEL_CACHE_ENV, "kernels", ".bonfire-kernels")
}

/// Where this process's CubeCL caches are, as [`place_kernel_caches`] found or put them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelCaches {
    /// In this directory (both the compiled kernels and the autotune verdicts).
    In(PathBuf),
    /// Where this CubeCL configuration file says.
    UserConfig(PathBuf),
    /// CubeCL was configured before the job started (by the program around it): left as it is.
    AlreadyConfigured,
}

impl KernelCaches {
    /// True when the autotune verdicts' directory holds none yet: a job with Burn's autotune on
    /// then tunes every matmul and convolution shape it meets, which takes minutes on the first
    /// run (BENCHMARKS.md, "Burn's fusion and autotune on CUDA").
    pub fn no_verdicts_yet(&self) -> bool {
        match self {
            KernelCaches::In(dir) => cache_entries(dir).0 == 0,
            _ => false,
        }
    }
}

/// What the caches in `root` hold: (autotune verdicts, compiled kernels), counted as CubeCL
/// writes them, one line per entry of its `.json.log` files (the verdicts under
/// `autotune/<version>/<device>/`, each runtime's table of compiled kernels in
/// `<runtime>/<version>/<format>/toc.json.log`).
pub fn cache_entries(root: &Path) -> (usize, usize) {
    fn walk(dir: &Path, verdicts: bool, counts: &mut (usize, usize)) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                walk(&path, verdicts, counts);
            } else if path.to_string_lossy().ends_with(".json.log") {
                let lines = std::fs::read(&path)
                    .map(|b| b.iter().filter(|&&c| c == b'\n').count())
                    .unwrap_or(0);
                if verdicts {
                    counts.0 += lines;
                } else if path.file_name().is_some_and(|n| n == "toc.json.log") {
                    counts.1 += lines;
                }
            }
        }
    }
    let mut counts = (0, 0);
    let Ok(entries) = std::fs::read_dir(root) else {
        return counts;
    };
    for e in entries.flatten() {
        if e.path().is_dir() {
            walk(&e.path(), e.file_name() == "autotune", &mut counts);
        }
    }
    counts
}

/// The CubeCL configuration file that applies in `dir`: the first `cubecl.toml` or
/// `CubeCL.toml`, or `burn.toml` or `Burn.toml` with a `[cubecl]` table, in `dir` or above it
/// (CubeCL's own search, which stops at the first directory with one of them).
pub fn cubecl_config_file(dir: &Path) -> Option<PathBuf> {
    for d in dir.ancestors() {
        for name in ["cubecl.toml", "CubeCL.toml"] {
            let path = d.join(name);
            if path.is_file() {
                return Some(path);
            }
        }
        for name in ["burn.toml", "Burn.toml"] {
            let path = d.join(name);
            let has_table = std::fs::read_to_string(&path)
                .is_ok_and(|text| text.lines().any(|l| l.trim_start().starts_with("[cubecl")));
            if has_table {
                return Some(path);
            }
        }
    }
    None
}

/// Points CubeCL's kernel and autotune caches at [`kernel_cache_root`], once per process, unless
/// a CubeCL configuration file applies or CubeCL is already configured. CubeCL's environment
/// variables (`CUBECL_AUTOTUNE_LEVEL`, `CUBECL_DEBUG_LOG`, ...) still apply.
pub fn place_kernel_caches() -> KernelCaches {
    static PLACED: OnceLock<KernelCaches> = OnceLock::new();
    PLACED
        .get_or_init(|| {
            let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
            if let Some(file) = cubecl_config_file(&cwd) {
                return KernelCaches::UserConfig(file);
            }
            let root = kernel_cache_root();
            let mut config = CubeClRuntimeConfig::default().override_from_env();
            config.compilation.cache = Some(CacheConfig::File(root.clone()));
            config.autotune.cache = CacheConfig::File(root.clone());
            // Set under CubeCL's own lock: `RuntimeConfig::set` panics if another thread got
            // there first, this leaves that configuration alone.
            let mut state = CubeClRuntimeConfig::storage().lock();
            if state.is_some() {
                return KernelCaches::AlreadyConfigured;
            }
            *state = Some(Arc::new(config));
            KernelCaches::In(root)
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_file_above_the_directory_applies_and_a_burn_toml_only_with_its_table() {
        let top = std::env::temp_dir().join(format!("bonfire-kc-{}", std::process::id()));
        let deep = top.join("a").join("b");
        std::fs::create_dir_all(&deep).unwrap();
        assert_eq!(cubecl_config_file(&deep), None);
        std::fs::write(top.join("a").join("burn.toml"), "[other]\nx = 1\n").unwrap();
        assert_eq!(cubecl_config_file(&deep), None);
        std::fs::write(
            top.join("burn.toml"),
            "[cubecl.autotune]\nlevel = \"minimal\"\n",
        )
        .unwrap();
        assert_eq!(cubecl_config_file(&deep), Some(top.join("burn.toml")));
        std::fs::write(deep.join("cubecl.toml"), "").unwrap();
        assert_eq!(cubecl_config_file(&deep), Some(deep.join("cubecl.toml")));
        std::fs::remove_dir_all(&top).unwrap();
    }

    #[test]
    fn both_caches_are_placed_once_in_the_kernel_cache_directory() {
        // The crate's directory has no CubeCL configuration above it, and no test of this
        // binary reads CubeCL's configuration before a job opens a GPU.
        let root = kernel_cache_root();
        let first = place_kernel_caches();
        assert_eq!(first, KernelCaches::In(root.clone()));
        let config = CubeClRuntimeConfig::get();
        assert!(
            matches!(&config.compilation.cache, Some(CacheConfig::File(d)) if *d == root),
            "{:?}",
            config.compilation.cache
        );
        assert!(
            matches!(&config.autotune.cache, CacheConfig::File(d) if *d == root),
            "{:?}",
            config.autotune.cache
        );
        assert_eq!(place_kernel_caches(), first);
    }

    #[test]
    fn verdicts_and_compiled_kernels_are_counted_as_cubecl_writes_them() {
        let root = std::env::temp_dir().join(format!("bonfire-kc-v-{}", std::process::id()));
        let caches = KernelCaches::In(root.clone());
        assert!(caches.no_verdicts_yet());
        assert_eq!(cache_entries(&root), (0, 0));
        let verdicts = root.join("autotune").join("0.10.0").join("cuda-0");
        let ptx = root.join("cuda").join("0.10.0").join("ptx");
        std::fs::create_dir_all(&verdicts).unwrap();
        std::fs::create_dir_all(&ptx).unwrap();
        assert!(caches.no_verdicts_yet());
        std::fs::write(ptx.join("toc.json.log"), "{}\n{}\n{}\n").unwrap();
        std::fs::write(ptx.join("chunk0.cbor"), "\n\n").unwrap();
        assert_eq!(cache_entries(&root), (0, 3));
        assert!(caches.no_verdicts_yet());
        std::fs::write(verdicts.join("matmul.json.log"), "{}\n{}\n").unwrap();
        std::fs::write(verdicts.join("conv.json.log"), "{}\n").unwrap();
        assert_eq!(cache_entries(&root), (3, 3));
        assert!(!caches.no_verdicts_yet());
        assert!(!KernelCaches::AlreadyConfigured.no_verdicts_yet());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
