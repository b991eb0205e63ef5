//! The vision job run from a program of one's own, without the command: this test is that
//! program. Run by the test harness it is the parent, which settles the run and starts two ranks;
//! each rank runs this same test binary with the same arguments (the library's default), finds
//! itself under the launcher and trains, taking the settled run the parent handed down.
//!
//! (This file holds a single test, so that a rank running the binary runs only it.)

use std::path::PathBuf;

use bonfire_jobs::vision::{Vision, VisionData, VisionRequest};
use bonfire_jobs::{Reporter, Role, RunOptions, Runner, Say, StepProgress, under_launcher};

/// Keeps what it is told.
#[derive(Default)]
struct Recording {
    lines: Vec<(Say, String)>,
    steps: usize,
}

impl Reporter for Recording {
    fn say(&mut self, kind: Say, text: &str) {
        self.lines.push((kind, text.to_string()));
    }

    fn step(&mut self, _: &StepProgress) {
        self.steps += 1;
    }
}

fn kinds(r: &Recording) -> Vec<Say> {
    r.lines.iter().map(|(k, _)| *k).collect()
}

#[test]
fn a_program_of_ones_own_runs_the_vision_job_and_gets_its_record_back() {
    let request = VisionRequest {
        dataset: Some(VisionData::Embedded),
        ranks: Some(2),
        batch: Some(32),
        width: Some(4),
        train_limit: Some(128),
        test_limit: Some(50),
        ..VisionRequest::default()
    };
    let dir: PathBuf =
        std::env::temp_dir().join(format!("bonfire-jobs-vision-{}", std::process::id()));
    let options = RunOptions {
        epochs: Some(1),
        checkpoint_dir: Some(dir.clone()),
        ..RunOptions::default()
    };
    let mut seen = Recording::default();
    let finished = Runner::new(&Vision, &request, &options)
        .reporter(&mut seen)
        .run()
        .unwrap();
    assert_eq!(finished.state.history.len(), 1);
    assert_eq!(finished.settings.config.dataset, VisionData::Embedded);
    if under_launcher() {
        // A rank: it trained, with the parent's settings (its own options name another
        // directory), and only rank 0 reported.
        let Role::Rank { rank, world } = finished.role else {
            panic!("a rank that is not one: {:?}", finished.role);
        };
        assert_eq!(world, 2);
        assert_ne!(finished.settings.checkpoint_dir, dir);
        let report = finished.report.expect("a rank's report");
        assert_eq!(report.throughput.items, 128);
        // Every batch of this rank was timed, each phase of it measured (the regression guard
        // `benches/step_time.sh` reads the split from the report line).
        assert_eq!(report.split.batches, 2);
        assert!(
            report.split.forward > std::time::Duration::ZERO
                && report.split.backward > report.split.exposed,
            "{:?}",
            report.split
        );
        if rank == 0 {
            let k = kinds(&seen);
            assert_eq!(&k[..2], &[Say::Start, Say::Epoch], "{:?}", seen.lines);
            // After the epoch's line: the report, and a straggler named if the timing says so.
            assert!(
                seen.lines[2..].iter().all(|(k, l)| *k == Say::Report
                    || (*k == Say::Notice && l.starts_with("straggler: "))),
                "{:?}",
                seen.lines
            );
            assert!(seen.lines[1].1.starts_with("epoch 1/1: train loss"));
            assert_eq!(seen.steps, 2);
        } else {
            assert!(seen.lines.is_empty() && seen.steps == 0);
        }
        return;
    }
    // The parent: it started the ranks, and reads the run's record back from its checkpoint.
    assert_eq!(finished.role, Role::Parent);
    assert!(finished.report.is_none());
    assert!(seen.lines.is_empty(), "{:?}", seen.lines);
    let last = &finished.state.history[0];
    assert_eq!((last.epoch, last.test_images), (1, 50));
    assert_eq!(last.param_digest.len(), 64);
    for file in ["latest", "epoch-1/state.json", "loss.png", "accuracy.png"] {
        assert!(dir.join(file).exists(), "{file}");
    }
    // Resuming a run that holds all its epochs starts nothing, and says so.
    let resume = RunOptions {
        resume: true,
        ..options
    };
    let again = Runner::new(&Vision, &VisionRequest::default(), &resume)
        .reporter(&mut seen)
        .run()
        .unwrap();
    assert_eq!(again.state, finished.state);
    assert_eq!(kinds(&seen), vec![Say::Notice]);
    assert!(seen.lines[0].1.contains("already holds all 1 epochs"));
    std::fs::remove_dir_all(&dir).unwrap();
}
