//! `bonfire::steady_heap` keeps freed memory in the process: a step that allocates and frees
//! the same blocks again faults no pages in after the first time. Its own test binary, so that
//! no other test has set glibc's thresholds first.
#![cfg(all(target_os = "linux", target_env = "gnu"))]

use bonfire::HeapSetting;

/// Page faults this thread has taken so far.
fn faults() -> i64 {
    // SAFETY: getrusage writes the struct it is given.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0);
        usage.ru_minflt
    }
}

/// One "step": a large block (which raises glibc's adjustable thresholds to its size), then
/// sixteen 1 MiB blocks, each written, then all freed. Returns the faults it took.
fn step() -> i64 {
    let before = faults();
    let big = vec![1u8; 4 << 20];
    drop(std::hint::black_box(big));
    let blocks: Vec<Vec<u8>> = (0..16).map(|i| vec![i as u8; 1 << 20]).collect();
    std::hint::black_box(&blocks);
    drop(blocks);
    faults() - before
}

#[test]
fn a_repeated_step_faults_no_pages_in_once_the_heap_is_steady() {
    if std::env::var_os("BONFIRE_MALLOC").is_some() || std::env::var_os("GLIBC_TUNABLES").is_some()
    {
        eprintln!("skipped: the environment sets malloc's behaviour");
        return;
    }
    // glibc's own thresholds: the 16 MiB freed at the top of the heap is more than twice the
    // largest block seen, so it goes back to the system every step and faults in again.
    let default: Vec<i64> = (0..4).map(|_| step()).collect();
    assert_eq!(bonfire::steady_heap(), HeapSetting::Fixed);
    step();
    let steady: Vec<i64> = (0..4).map(|_| step()).collect();
    eprintln!("faults per step: glibc's thresholds {default:?}, steady {steady:?}");
    // 16 MiB is 4,096 pages; a step served from memory the heap kept takes almost none.
    assert!(
        steady.iter().all(|&f| f < 64),
        "freed memory went back to the system: faults per step {steady:?} (glibc's own \
         thresholds: {default:?})"
    );
}
