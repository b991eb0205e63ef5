//! "Coming from PyTorch DDP", gradient accumulation: the chapter's loop
//! ([`bonfire_book::accumulation_step`], included into the chapter as written) on two ranks with
//! two micro-batches each ends with the parameters of one rank stepping on the union batch, within
//! 1e-6 after three SGD steps with momentum; and on one rank, four micro-batches give the same.

use std::time::Duration;

use bonfire_book::accumulation_step;
use bonfire_testkit::nets::{
    Batch, DpFlex, Net, SmallCnn, loss, max_abs_diff, parameters, random_batches, seeded,
};
use bonfire_testkit::{RankModels, bind_rank, in_process_ranks, run_ranks};
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;

type Device = burn::backend::flex::FlexDevice;

const STEPS: usize = 3;
const ROWS: usize = 8;

/// `micro` micro-batches per step, each rank on its `1/world` of every batch.
fn train(world: usize, micro: usize, batches: &[Batch]) -> Vec<Vec<Vec<f32>>> {
    let device = Device::default();
    // Other seeds on the other ranks: the loop relies on `replicate` to start from rank 0's.
    let models =
        RankModels::seeded::<DpFlex>(world, |r| 1 + 1000 * r as u64, &device, SmallCnn::new);
    let batches = batches.to_vec();
    run_ranks(
        in_process_ranks(world, Duration::from_secs(20)),
        Duration::from_secs(120),
        move |comm| {
            let r = comm.rank();
            let device = Device::default();
            let _bind = bind_rank(comm);
            let mut model = bonfire::replicate(models.take(r));
            let mut optim = SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new()))
                .init();
            let rows = ROWS / world / micro;
            for batch in &batches {
                let mine = batch.slice(r * ROWS / world, ROWS / world);
                let micro_batches: Vec<Batch> =
                    (0..micro).map(|m| mine.slice(m * rows, rows)).collect();
                model = accumulation_step(model, &mut optim, 0.1, &micro_batches, |m, b| {
                    loss(m, b, 1.0, &device)
                });
            }
            parameters(&model)
        },
    )
}

#[test]
fn the_chapters_loop_on_two_ranks_steps_as_one_rank_on_the_union_batch() {
    let batches = random_batches(21, STEPS, ROWS, SmallCnn::<DpFlex>::FEATURES, 10);
    let union = train(1, 1, &batches).remove(0);
    let ranks = train(2, 2, &batches);
    assert_eq!(ranks[0], ranks[1], "the replicas differ");
    let d = max_abs_diff(&union, &ranks[0]);
    assert!(
        d <= 1e-6,
        "2 ranks x 2 micro-batches differ from the union batch by {d:e}"
    );
    let moved = max_abs_diff(
        &union,
        &parameters(&seeded::<DpFlex, _>(1, &Device::default(), SmallCnn::new)),
    );
    assert!(
        moved > 1e-3,
        "training moved the parameters by {moved:e} only"
    );
    let alone = train(1, 4, &batches).remove(0);
    let d = max_abs_diff(&union, &alone);
    assert!(
        d <= 1e-6,
        "1 rank x 4 micro-batches differs from the union batch by {d:e}"
    );
}
