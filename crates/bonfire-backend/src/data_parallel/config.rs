//! How `DataParallel` synchronises gradients: bucket sizes, the element type gradients travel in,
//! what a rank does when synchronisation fails, and how these are read from the environment.

use thiserror::Error;

/// The element type gradients travel in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GradDType {
    /// Full precision (the default).
    #[default]
    F32,
    /// bfloat16, half the bytes. The rounding error of each step is kept on the rank and added to
    /// the next step's gradient (error feedback), so it does not bias training.
    Bf16,
}

/// Who moves a bucket's bytes while backward is still running.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlap {
    /// A bucket's all-reduce starts when the bucket is full; the communication runtime's threads
    /// run it while backward goes on (PyTorch DDP's way). The default: best where those threads
    /// find a free core (a GPU computes, or the node has cores to spare).
    #[default]
    Threads,
    /// A bucket's all-reduce starts when the bucket is full, and backward's own thread runs it,
    /// a little at each gradient hook (between backward's ops), then to the end once backward
    /// is done: no communication thread is woken to run it (the transport's reader still files
    /// frames as they come), so almost nothing competes with compute for a core.
    Hooks,
    /// Every all-reduce starts when backward is done (no overlap).
    End,
}

impl Overlap {
    fn parse(v: &str) -> Option<Overlap> {
        match v.trim().to_ascii_lowercase().as_str() {
            "threads" => Some(Overlap::Threads),
            "hooks" => Some(Overlap::Hooks),
            "end" => Some(Overlap::End),
            _ => None,
        }
    }
}

/// What a rank does when gradient synchronisation fails (a peer died, left early, timed out, or
/// runs a different model). Burn's ops cannot return errors, so `backward` cannot either.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Print the error (which names the rank, the collective and the sizes) and exit the process
    /// with status 1. The default: under `bonfire launch`, the launcher then stops the job.
    #[default]
    Exit,
    /// Panic with the error, for ranks run as threads (tests, one-process jobs), where the
    /// thread's join reports it.
    Panic,
}

/// How `DataParallel` synchronises gradients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataParallelConfig {
    /// Bucket cap in bytes of communicated gradient (default 25 MiB, as PyTorch DDP). Larger
    /// buckets mean fewer collectives; smaller ones start communication earlier in backward.
    pub bucket_cap_bytes: usize,
    /// Cap of the first bucket (default 1 MiB), so the first all-reduce starts early.
    pub first_bucket_cap_bytes: usize,
    /// The element type gradients travel in.
    pub grad_dtype: GradDType,
    /// What to do when synchronisation fails.
    pub failure: FailurePolicy,
    /// Pack and unpack buckets on the device with the fused kernels when the inner backend is a
    /// CubeCL one (wgpu, CUDA; default true). False reads and writes every gradient on its own.
    pub device_pack: bool,
    /// All-reduce device-packed CUDA buckets through the device lane (default true): the
    /// bucket stays in device memory, mapped between the processes of one host with CUDA IPC
    /// and reduced by one fused kernel per rank (`bonfire_kernels::lane`); across hosts each
    /// node reduce-scatters on the device and only each rank's share crosses nodes. Used for f32
    /// gradients that are all-reduced (not under ZeRO stage 2) when every rank can join; the
    /// others keep the host lane. False always takes the host lane.
    pub device_lane: bool,
    /// Run the whole synchronisation path at world size 1 (default false): mark the parameters,
    /// fire the gradient hook, plan and pack the buckets, all-reduce them over a group of one and
    /// write the averages back, as every rank of several does. Off, a job of one rank runs no
    /// bonfire code in backward. For measuring what the decorator itself costs
    /// (`benches/dp-overhead`); the gradients are the same either way.
    pub sync_alone: bool,
    /// Who moves buckets while backward runs (see [`Overlap`]).
    pub overlap: Overlap,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        DataParallelConfig {
            bucket_cap_bytes: 25 << 20,
            first_bucket_cap_bytes: 1 << 20,
            grad_dtype: GradDType::F32,
            failure: FailurePolicy::Exit,
            device_pack: true,
            device_lane: true,
            sync_alone: false,
            overlap: Overlap::Threads,
        }
    }
}

impl DataParallelConfig {
    /// The defaults, changed by `BONFIRE_BUCKET_CAP_MB` (a positive number, fractions allowed)
    /// `BONFIRE_GRAD_DTYPE` (`f32` or `bf16`), `BONFIRE_DEVICE_PACK`, `BONFIRE_DEVICE_LANE` and
    /// `BONFIRE_SYNC_ALONE` (`1` or `0`). A malformed value is an error naming the variable.
    pub fn from_env() -> Result<Self, ConfigError> {
        let cap = std::env::var("BONFIRE_BUCKET_CAP_MB").ok();
        let dtype = std::env::var("BONFIRE_GRAD_DTYPE").ok();
        let mut config = Self::from_vars(cap.as_deref(), dtype.as_deref())?;
        if let Ok(v) = std::env::var("BONFIRE_DEVICE_PACK") {
            config.device_pack = parse_switch(&v).ok_or(ConfigError::DevicePack { value: v })?;
        }
        if let Ok(v) = std::env::var("BONFIRE_DEVICE_LANE") {
            config.device_lane = parse_switch(&v).ok_or(ConfigError::DeviceLane { value: v })?;
        }
        if let Ok(v) = std::env::var("BONFIRE_SYNC_ALONE") {
            config.sync_alone = parse_switch(&v).ok_or(ConfigError::SyncAlone { value: v })?;
        }
        if let Ok(v) = std::env::var("BONFIRE_OVERLAP") {
            config.overlap = Overlap::parse(&v).ok_or(ConfigError::Overlap { value: v })?;
        }
        Ok(config)
    }

    fn from_vars(cap: Option<&str>, dtype: Option<&str>) -> Result<Self, ConfigError> {
        let mut config = DataParallelConfig::default();
        if let Some(v) = cap {
            match v.trim().parse::<f64>() {
                Ok(mb) if mb > 0.0 && mb.is_finite() => {
                    config.bucket_cap_bytes = ((mb * 1048576.0) as usize).max(4);
                    config.first_bucket_cap_bytes =
                        config.first_bucket_cap_bytes.min(config.bucket_cap_bytes);
                }
                _ => {
                    return Err(ConfigError::BucketCap {
                        value: v.to_string(),
                    });
                }
            }
        }
        if let Some(v) = dtype {
            config.grad_dtype = match v.trim().to_ascii_lowercase().as_str() {
                "f32" | "float32" => GradDType::F32,
                "bf16" | "bfloat16" => GradDType::Bf16,
                _ => {
                    return Err(ConfigError::GradDType {
                        value: v.to_string(),
                    });
                }
            };
        }
        Ok(config)
    }
}

/// `1`/`true`/`on`/`yes` or `0`/`false`/`off`/`no`.
fn parse_switch(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// A malformed data-parallel setting in the environment. Its message names the variable.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// `BONFIRE_BUCKET_CAP_MB` is not a positive number.
    #[error("BONFIRE_BUCKET_CAP_MB={value:?}: expected a positive number of MiB, e.g. 25")]
    BucketCap {
        /// The value found.
        value: String,
    },
    /// `BONFIRE_GRAD_DTYPE` is not a known element type.
    #[error("BONFIRE_GRAD_DTYPE={value:?}: expected f32 or bf16")]
    GradDType {
        /// The value found.
        value: String,
    },
    /// `BONFIRE_DEVICE_PACK` is not a switch.
    #[error("BONFIRE_DEVICE_PACK={value:?}: expected 1 or 0")]
    DevicePack {
        /// The value found.
        value: String,
    },
    /// `BONFIRE_DEVICE_LANE` is not a switch.
    #[error("BONFIRE_DEVICE_LANE={value:?}: expected 1 or 0")]
    DeviceLane {
        /// The value found.
        value: String,
    },
    /// `BONFIRE_SYNC_ALONE` is not a switch.
    #[error("BONFIRE_SYNC_ALONE={value:?}: expected 1 or 0")]
    SyncAlone {
        /// The value found.
        value: String,
    },
    /// `BONFIRE_OVERLAP` is not a known mode.
    #[error("BONFIRE_OVERLAP={value:?}: expected threads, hooks or end")]
    Overlap {
        /// The value found.
        value: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_parsed_and_bad_values_name_their_variable() {
        let c = DataParallelConfig::from_vars(Some("0.5"), Some("BF16")).unwrap();
        assert_eq!(c.bucket_cap_bytes, 1 << 19);
        assert_eq!(c.first_bucket_cap_bytes, 1 << 19);
        assert_eq!(c.grad_dtype, GradDType::Bf16);
        assert_eq!(
            DataParallelConfig::from_vars(None, None).unwrap(),
            DataParallelConfig::default()
        );
        for (cap, dtype, var) in [
            (Some("-1"), None, "BONFIRE_BUCKET_CAP_MB"),
            (Some("lots"), None, "BONFIRE_BUCKET_CAP_MB"),
            (None, Some("fp8"), "BONFIRE_GRAD_DTYPE"),
        ] {
            let err = DataParallelConfig::from_vars(cap, dtype)
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(var), "{err}");
        }
        assert_eq!(parse_switch(" Off"), Some(false));
        assert_eq!(parse_switch("1"), Some(true));
        assert_eq!(parse_switch("maybe"), None);
        assert_eq!(Overlap::parse(" Hooks"), Some(Overlap::Hooks));
        assert_eq!(Overlap::parse("end"), Some(Overlap::End));
        assert_eq!(Overlap::parse("sometimes"), None);
    }
}
