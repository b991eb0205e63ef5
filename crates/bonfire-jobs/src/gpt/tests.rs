use super::*;

fn config() -> GptRunConfig {
    let request = GptRequest {
        dataset: Some(GptData::Embedded),
        steps: Some(1000),
        ..GptRequest::default()
    };
    let dir = std::env::temp_dir();
    GptJob
        .configure(&request, 2, &dir, &mut crate::Silent)
        .unwrap()
}

#[test]
fn the_defaults_are_a_small_model_on_the_embedded_plays() {
    let c = config();
    assert_eq!((c.layers, c.heads, c.embd, c.context), (4, 4, 128, 64));
    assert_eq!(
        (c.batch, c.grad_accum, c.eval_every, c.warmup),
        (16, 1, 200, 100)
    );
    assert_eq!(c.rounds(), 5);
    assert_eq!(GptJob.rounds(&c), Some(5));
    assert_eq!(c.tokens_per_step(), 2 * 16 * 64);
    let vocab = c.vocab();
    assert!(vocab.len() > 50 && vocab.id('\n').is_some(), "{}", c.vocab);
    let params = c.model().init::<burn::backend::Flex>(&Default::default());
    let n = burn::module::Module::num_params(&params);
    assert!((700_000..1_200_000).contains(&n), "{n} parameters");
}

#[test]
fn the_learning_rate_warms_up_then_follows_a_cosine_to_a_tenth() {
    let c = GptRunConfig {
        steps: 110,
        warmup: 10,
        lr: 1.0,
        ..config()
    };
    assert!((c.lr_at(0) - 0.1).abs() < 1e-12);
    assert!((c.lr_at(9) - 1.0).abs() < 1e-12);
    assert!((c.lr_at(10) - 1.0).abs() < 1e-12);
    // Half way down the cosine: the mean of the peak and the floor.
    assert!((c.lr_at(60) - 0.55).abs() < 1e-12);
    assert!((c.lr_at(110) - 0.1).abs() < 1e-12);
    for s in 10..110 {
        assert!(c.lr_at(s + 1) <= c.lr_at(s));
    }
}

#[test]
fn bad_requests_name_the_flag() {
    let bad = |r: GptRequest| GptJob.check(&r).unwrap_err().to_string();
    let e = bad(GptRequest {
        heads: Some(3),
        ..GptRequest::default()
    });
    assert_eq!(
        e,
        "--heads 3 with --embd 128: the heads must divide the model width"
    );
    assert!(
        bad(GptRequest {
            steps: Some(0),
            ..GptRequest::default()
        })
        .starts_with("--steps 0")
    );
    assert!(
        bad(GptRequest {
            warmup: Some(50),
            steps: Some(50),
            ..GptRequest::default()
        })
        .starts_with("--warmup 50 with --steps 50")
    );
    assert!(GptJob.check(&GptRequest::default()).is_ok());
    assert_eq!(
        "Tolstoy".parse::<GptData>().unwrap_err().to_string(),
        "--dataset \"Tolstoy\": expected shakespeare or embedded"
    );
    let e = JobError::Invalid {
        flag: "--heads",
        given: "3".into(),
        why: "x",
    };
    assert!(e.is_usage());
}

#[test]
fn a_resume_keeps_the_settings_and_the_vocabulary() {
    let saved = config();
    let same = GptRequest {
        steps: Some(1000),
        dp: Some(2),
        ..GptRequest::default()
    };
    assert!(GptJob.clashes(&same, &saved).is_empty());
    let changed = GptRequest {
        lr: Some(0.01),
        bf16: true,
        ..GptRequest::default()
    };
    let c: Vec<String> = GptJob
        .clashes(&changed, &saved)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        c,
        vec![
            "--lr 0.01 (the checkpoint has 0.002)",
            "--bf16-comm on (the checkpoint has f32 gradients)",
        ]
    );
    let dir = std::env::temp_dir();
    GptJob.prepare(&saved, &dir).unwrap();
    let other = GptRunConfig {
        vocab: "abc".into(),
        ..saved
    };
    let e = GptJob.prepare(&other, &dir).unwrap_err();
    assert!(e.is_usage());
    assert!(
        e.to_string()
            .starts_with("the checkpoint's vocabulary (3 characters) is not the vocabulary of the embedded text here"),
        "{e}"
    );
}

#[test]
fn tensor_parallel_sizes_must_divide_the_heads_and_the_ranks() {
    let dir = std::env::temp_dir();
    let r = GptRequest {
        dataset: Some(GptData::Embedded),
        tp: Some(2),
        ..GptRequest::default()
    };
    assert_eq!(GptJob.requested_ranks(&r), Some(4));
    let e = GptJob
        .configure(&r, 3, &dir, &mut crate::Silent)
        .unwrap_err();
    assert!(e.is_usage());
    assert_eq!(
        e.to_string(),
        "--tp 2 in a job of 3 ranks: the tensor-parallel size must divide the ranks"
    );
    let c = GptJob.configure(&r, 4, &dir, &mut crate::Silent).unwrap();
    assert_eq!((c.dp(), c.tp, c.tensor_parallel()), (2, 2, 2));
    // 67 characters, padded to 68 for a split by vocabulary over 2 ranks.
    assert_eq!(c.vocab.chars().count(), 67);
    assert_eq!(c.model().vocab, 68);
    assert_eq!(c.tokens_per_step(), 2 * 16 * 64);
    let bad = GptRequest {
        tp: Some(3),
        ..GptRequest::default()
    };
    assert!(
        GptJob
            .check(&bad)
            .unwrap_err()
            .to_string()
            .starts_with("--tp 3 with --heads 4")
    );
}

#[test]
fn chunks_interleave_a_one_f_one_b_pipeline_whose_stages_divide_the_micro_batches() {
    let dir = std::env::temp_dir();
    let request = |pp: usize, chunks: usize, micro: usize, layers: usize| GptRequest {
        dataset: Some(GptData::Embedded),
        pp: Some(pp),
        chunks: Some(chunks),
        grad_accum: Some(micro),
        layers: Some(layers),
        ..GptRequest::default()
    };
    let configure =
        |r: &GptRequest| GptJob.configure(r, 2 * r.pp.unwrap(), &dir, &mut crate::Silent);
    let c = configure(&request(2, 2, 4, 4)).unwrap();
    assert_eq!((c.pp, c.chunks, c.ranks), (2, 2, 4));
    // One chunk is the plain pipeline, and runs without one.
    assert_eq!(configure(&request(1, 1, 1, 4)).unwrap().chunks, 1);
    let refused = |r: GptRequest| {
        let e = configure(&r).unwrap_err();
        assert!(e.is_usage(), "{e}");
        e.to_string()
    };
    assert_eq!(
        refused(request(1, 2, 4, 4)),
        "--chunks 2 without --pp: chunks interleave a pipeline's stages: they need --pp 2 or more"
    );
    assert_eq!(
        refused(GptRequest {
            schedule: Some(Schedule::GPipe),
            ..request(2, 2, 4, 4)
        }),
        "--chunks 2 with --schedule gpipe: interleaving runs the 1f1b schedule"
    );
    assert!(
        refused(request(2, 3, 4, 4))
            .starts_with("--chunks 3 with --pp 2 and --layers 4: each chunk"),
    );
    assert!(
        refused(request(2, 2, 3, 4))
            .starts_with("--chunks 2 with --pp 2 and --micro-batches 3: interleaving takes"),
    );
    // On a resume the checkpoint's chunks are kept where they fit the pipeline, else 1.
    let resumed = |r: GptRequest| GptJob.resumed_config(&r, c.clone());
    assert_eq!(resumed(GptRequest::default()).unwrap().chunks, 2);
    let one = resumed(GptRequest {
        pp: Some(1),
        ..GptRequest::default()
    })
    .unwrap();
    assert_eq!((one.pp, one.chunks, one.ranks), (1, 1, 2));
    let asked = resumed(GptRequest {
        chunks: Some(1),
        ..GptRequest::default()
    })
    .unwrap();
    assert_eq!((asked.pp, asked.chunks), (2, 1));
    assert!(
        resumed(GptRequest {
            pp: Some(4),
            chunks: Some(2),
            ..GptRequest::default()
        })
        .unwrap_err()
        .to_string()
        .starts_with("--chunks 2 with --pp 4 and --layers 4")
    );
}
