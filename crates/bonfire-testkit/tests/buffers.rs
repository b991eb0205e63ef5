//! `sync_buffers` makes every rank's batch-norm running statistics equal (the mean over the
//! ranks, or rank 0's) and leaves trained parameters alone; checked against the statistics each
//! rank computed on its own.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use bonfire::backend::{DataParallelConfig, FailurePolicy, bind_thread};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire::{BufferSync, sync_buffers};
use bonfire_testkit::nets::DpFlex;
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{Distribution, Tensor};

type Device = burn::backend::flex::FlexDevice;

/// One rank's running mean and variance and its scale (gamma), before and after the sync.
#[derive(Debug, Clone)]
struct Seen {
    own_mean: Vec<f32>,
    own_var: Vec<f32>,
    mean: Vec<f32>,
    var: Vec<f32>,
    gamma_before: Vec<f32>,
    gamma: Vec<f32>,
}

fn values<const D: usize>(t: Tensor<DpFlex, D>) -> Vec<f32> {
    t.into_data().to_vec().unwrap()
}

fn run(how: BufferSync, channels: [usize; 2], skip: Option<usize>) -> Vec<Result<Seen, String>> {
    let comms = Communicator::in_process(
        2,
        CommConfig {
            timeout: Duration::from_secs(2),
            ..CommConfig::default()
        },
    );
    let (tx, rx) = mpsc::channel();
    let tx = Arc::new(std::sync::Mutex::new(tx));
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let _bind = bind_thread(
                    comm,
                    DataParallelConfig {
                        failure: FailurePolicy::Panic,
                        ..DataParallelConfig::default()
                    },
                );
                let device = Device::default();
                let c = channels[r];
                let bn: BatchNorm<DpFlex> = BatchNormConfig::new(c).init(&device);
                let bn = bonfire::replicate(bn);
                // Each rank sees other data: rank r's inputs are centred on 3r.
                for _ in 0..3 {
                    let x = Tensor::<DpFlex, 3>::random(
                        [8, c, 5],
                        Distribution::Normal(3.0 * r as f64, 1.0 + r as f64),
                        &device,
                    );
                    let _ = bn.forward(x);
                }
                let own_mean = values(bn.running_mean.value());
                let own_var = values(bn.running_var.value());
                let gamma_before = values(bn.gamma.val());
                if skip == Some(r) {
                    return;
                }
                let bn = sync_buffers(bn, how);
                let seen = Seen {
                    own_mean,
                    own_var,
                    mean: values(bn.running_mean.value()),
                    var: values(bn.running_var.value()),
                    gamma_before,
                    gamma: values(bn.gamma.val()),
                };
                tx.lock().unwrap().send((r, seen)).unwrap();
            })
        })
        .collect();
    drop(tx);
    let mut out: Vec<Result<Seen, String>> = vec![Err(String::new()), Err(String::new())];
    for (r, h) in handles.into_iter().enumerate() {
        if let Err(p) = h.join() {
            out[r] = Err(p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default());
        }
    }
    for (r, seen) in rx {
        out[r] = Ok(seen);
    }
    out
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
}

#[test]
fn averaged_buffers_are_the_mean_of_each_ranks_own() {
    let seen: Vec<Seen> = run(BufferSync::Average, [4, 4], None)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        !close(&seen[0].own_mean, &seen[1].own_mean),
        "the ranks saw the same data"
    );
    let mean: Vec<f32> = (0..4)
        .map(|i| (seen[0].own_mean[i] + seen[1].own_mean[i]) / 2.0)
        .collect();
    let var: Vec<f32> = (0..4)
        .map(|i| (seen[0].own_var[i] + seen[1].own_var[i]) / 2.0)
        .collect();
    for s in &seen {
        assert!(close(&s.mean, &mean), "{:?} vs {mean:?}", s.mean);
        assert!(close(&s.var, &var), "{:?} vs {var:?}", s.var);
        assert_eq!(s.gamma, s.gamma_before, "a trained parameter was touched");
    }
}

#[test]
fn from_rank_0_every_rank_takes_rank_0s_buffers() {
    let seen: Vec<Seen> = run(BufferSync::FromRank0, [3, 3], None)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for s in &seen {
        assert_eq!(s.mean, seen[0].own_mean);
        assert_eq!(s.var, seen[0].own_var);
    }
    assert_ne!(seen[1].own_mean, seen[0].own_mean);
}

#[test]
fn a_rank_that_does_not_sync_is_named_with_the_buffer() {
    let out = run(BufferSync::Average, [4, 4], Some(1));
    let msg = out[0].as_ref().expect_err("rank 0 went on alone");
    assert!(msg.contains("rank 0 of 2"), "{msg}");
    assert!(
        msg.contains("Average of buffer running_mean (4 elements)"),
        "{msg}"
    );
    assert!(
        msg.contains("rank 1"),
        "names the rank it waited for: {msg}"
    );
}
