//! Int8 deltas for [`super::outer::LocalSgd`]'s meetings: a quarter of f32's bytes, with error
//! feedback at both places a value is rounded.
//!
//! Int8 values cannot be summed in int8 along a ring (the sum overflows and each hop would round
//! again), so the mean is taken in two stages over point-to-point messages, as compressed
//! all-reduces of the 1-bit Adam kind do:
//!
//! 1. Each rank adds its kept rounding error to its (already scaled) delta and quantizes the
//!    result: the elements are dealt into one contiguous chunk per rank ([`chunk`]), each chunk
//!    quantized in blocks of [`BLOCK`] with one f32 scale per block (the block's largest
//!    magnitude over 127). What the rounding lost stays on the rank for its next meeting. Chunk
//!    `j` goes to rank `j`.
//! 2. Rank `j` sums the chunks it received in f32, in rank order, adds its own kept error of
//!    this stage, quantizes the sum the same way (keeping what it lost) and all-gathers it.
//!    Every rank decodes the same bytes, so every rank ends with the same mean, bit for bit.
//!
//! Each rank sends `2 (ranks - 1) / ranks` of the int8 message (its elements plus 4 bytes per
//! block), where a ring all-reduce sends as much of the f32 buffer: 4x fewer bytes per rank, less
//! the scales' 1.6%. The first stage is a flat exchange between every pair of ranks, not
//! arranged by node: across a link between nodes of several ranks each, where f32's hierarchical
//! all-reduce sends each node's sum over the link once, int8 saves less than 4x: about 2x at two
//! ranks per node, nothing from about four, and beyond that it sends more than f32.

use std::ops::Range;

use bonfire_collectives::{CollectiveError, Communicator};

/// Elements per block: each has its own scale.
pub(crate) const BLOCK: usize = 256;

/// The elements of `n` that rank `r` of `ranks` owns: `n / ranks` each, one more for the first
/// `n % ranks` ranks.
pub(crate) fn chunk(n: usize, ranks: usize, r: usize) -> Range<usize> {
    let (base, extra) = (n / ranks, n % ranks);
    let start = r * base + r.min(extra);
    start..start + base + usize::from(r < extra)
}

/// Bytes of the message of `len` quantized values: one f32 scale per block, then one byte per
/// value.
pub(crate) fn message_len(len: usize) -> usize {
    4 * len.div_ceil(BLOCK) + len
}

/// Appends to `out` the message of `values` (the scales, then the int8 values) and writes into
/// `error` (as long as `values`) what each value lost. A block that holds a NaN or an infinity
/// gets a NaN scale, so the whole block decodes as NaN (and so does the sum it enters, and the
/// error kept): a diverged replica shows in the mean as it would in f32, instead of being
/// rounded to zero (`f32::max` passes over NaN).
pub(crate) fn quantize(values: &[f32], error: &mut [f32], out: &mut Vec<u8>) {
    debug_assert_eq!(values.len(), error.len());
    let scales: Vec<f32> = values
        .chunks(BLOCK)
        .map(|block| {
            if block.iter().all(|v| v.is_finite()) {
                block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0
            } else {
                f32::NAN
            }
        })
        .collect();
    for s in &scales {
        out.extend_from_slice(&s.to_le_bytes());
    }
    for ((block, err), &s) in values
        .chunks(BLOCK)
        .zip(error.chunks_mut(BLOCK))
        .zip(&scales)
    {
        for (v, e) in block.iter().zip(err) {
            let q = if s > 0.0 && s.is_finite() {
                (v / s).round().clamp(-127.0, 127.0)
            } else {
                0.0
            };
            out.push(q as i8 as u8);
            *e = v - q * s;
        }
    }
}

/// Decodes the message `msg` of `out.len()` values, adding each to `out`.
pub(crate) fn add_decoded(msg: &[u8], out: &mut [f32]) {
    let blocks = out.len().div_ceil(BLOCK);
    debug_assert_eq!(msg.len(), message_len(out.len()));
    let (scales, values) = msg.split_at(4 * blocks);
    for ((o, q), s) in out
        .chunks_mut(BLOCK)
        .zip(values.chunks(BLOCK))
        .zip(scales.chunks_exact(4))
    {
        let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        for (o, &q) in o.iter_mut().zip(q) {
            *o += f32::from(q as i8) * s;
        }
    }
}

/// The mean of every rank's `values` (each already scaled by `1 / ranks`) through int8 messages,
/// as the module docs say. `residual` is this rank's kept error: `values.len()` elements for the
/// first stage, then as many as its own chunk for the second (zeros at the first meeting). Returns
/// the mean, equal on every rank, and the bytes of this rank's first-stage message (every chunk,
/// its own included), the size of its int8 buffer.
pub(crate) fn mean(
    comm: &Communicator,
    values: &[f32],
    residual: &mut [f32],
) -> Result<(Vec<f32>, usize), CollectiveError> {
    let (n, ranks, me) = (values.len(), comm.size(), comm.rank());
    let mine = chunk(n, ranks, me);
    assert_eq!(
        residual.len(),
        n + mine.len(),
        "an int8 residual holds both stages' errors"
    );
    let (first, second) = residual.split_at_mut(n);
    let fed: Vec<f32> = values
        .iter()
        .zip(first.iter())
        .map(|(v, e)| v + e)
        .collect();
    let mut bytes = 0;
    let mut messages = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let range = chunk(n, ranks, r);
        let mut msg = Vec::with_capacity(message_len(range.len()));
        quantize(&fed[range.clone()], &mut first[range], &mut msg);
        bytes += msg.len();
        messages.push(msg);
    }
    // Every send and receive at once: each rank sends every other its chunk, and receives that
    // rank's message of its own chunk in the sent one's place (empty chunks travel not at all).
    let own_len = message_len(mine.len());
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for (r, msg) in messages.iter_mut().enumerate().filter(|&(r, _)| r != me) {
        if !msg.is_empty() {
            sends.push(comm.send(std::mem::take(msg), r));
        }
        if own_len > 0 {
            recvs.push((r, comm.recv(vec![0u8; own_len], r)));
        }
    }
    for (r, work) in recvs {
        messages[r] = work.wait()?;
    }
    for send in sends {
        send.wait()?;
    }
    // Summed in rank order, this rank's own chunk in its place.
    let mut sum = vec![0.0f32; mine.len()];
    for msg in &messages {
        add_decoded(msg, &mut sum);
    }
    for (s, e) in sum.iter_mut().zip(second.iter()) {
        *s += e;
    }
    let mut reduced = Vec::with_capacity(own_len);
    quantize(&sum, second, &mut reduced);
    let counts: Vec<usize> = (0..ranks)
        .map(|r| message_len(chunk(n, ranks, r).len()))
        .collect();
    let all = comm.all_gather_uneven(reduced, &counts).wait()?;
    let mut mean = vec![0.0f32; n];
    let mut at = 0;
    for (r, len) in counts.iter().enumerate() {
        add_decoded(&all[at..at + len], &mut mean[chunk(n, ranks, r)]);
        at += len;
    }
    Ok((mean, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use bonfire_collectives::CommConfig;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn chunks_deal_every_element_once() {
        for (n, ranks) in [(0, 3), (2, 4), (10, 3), (1031, 4), (7, 1)] {
            let mut at = 0;
            for r in 0..ranks {
                let c = chunk(n, ranks, r);
                assert_eq!(c.start, at, "n {n} ranks {ranks} rank {r}");
                assert!(c.len() == n / ranks || c.len() == n / ranks + 1);
                at = c.end;
            }
            assert_eq!(at, n);
        }
    }

    #[test]
    fn a_block_round_trips_within_half_a_step_and_keeps_what_it_lost() {
        let values: Vec<f32> = (0..600).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        let mut error = vec![0.0; values.len()];
        let mut msg = Vec::new();
        quantize(&values, &mut error, &mut msg);
        assert_eq!(msg.len(), message_len(600));
        assert_eq!(msg.len(), 4 * 3 + 600);
        let mut back = vec![0.0; values.len()];
        add_decoded(&msg, &mut back);
        for ((v, b), e) in values.iter().zip(&back).zip(&error) {
            // The block's largest magnitude is 50: a step of 50 / 127.
            assert!(
                (v - b).abs() <= 0.5 * 50.0 / 127.0 + 1e-5,
                "{v} came back as {b}"
            );
            assert_eq!(*e, v - b, "the error is what the value lost");
        }
        // The largest magnitude is exact.
        let at = values.iter().position(|&v| v == -50.0).unwrap();
        assert_eq!(back[at], -50.0);
        // Zeros stay zeros; a non-finite block decodes as NaN.
        let mut error = vec![0.0; 4];
        let mut msg = Vec::new();
        quantize(&[0.0, 0.0, 0.0, 0.0], &mut error, &mut msg);
        let mut back = vec![0.0; 4];
        add_decoded(&msg, &mut back);
        assert_eq!(back, vec![0.0; 4]);
        for bad in [f32::INFINITY, f32::NAN] {
            let mut msg = Vec::new();
            quantize(&[1.0, bad, 2.0, 3.0], &mut error, &mut msg);
            let mut back = vec![0.0; 4];
            add_decoded(&msg, &mut back);
            assert!(back.iter().all(|b| b.is_nan()), "{bad}: {back:?}");
        }
    }

    /// Runs one meeting of `values` (one vector per rank), each rank on its own thread.
    fn meet(values: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        let n = values[0].len();
        let comms = Communicator::in_process(
            values.len(),
            CommConfig {
                timeout: Duration::from_secs(20),
                ..CommConfig::default()
            },
        );
        let handles: Vec<_> = comms
            .into_iter()
            .zip(values)
            .map(|(comm, v)| {
                std::thread::spawn(move || {
                    let mut res = vec![0.0; n + chunk(n, comm.size(), comm.rank()).len()];
                    mean(&comm, &v, &mut res).expect("mean").0
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn a_nan_or_an_infinity_on_one_rank_is_nan_in_its_block_on_every_rank() {
        // 3 ranks, 3 blocks each of the 2,304 elements: a NaN on rank 1 at element 10 (rank 0's
        // chunk, first block), an infinity on rank 2 at element 1,800 (rank 2's chunk, second
        // block); the other blocks stay finite.
        let n = 2304;
        let mut values = vec![vec![1e-3f32; n]; 3];
        values[1][10] = f32::NAN;
        values[2][1800] = f32::INFINITY;
        let means = meet(values);
        let nan_blocks = [0..256, 1792..2048];
        for (r, mean) in means.iter().enumerate() {
            for (i, m) in mean.iter().enumerate() {
                let poisoned = nan_blocks.iter().any(|b| b.contains(&i));
                assert_eq!(m.is_nan(), poisoned, "rank {r}, element {i}: {m}");
            }
        }
    }

    /// The two stages done one rank after the other on one thread, with every rank's state.
    fn oracle(values: &[Vec<f32>], residuals: &mut [Vec<f32>]) -> Vec<f32> {
        let (ranks, n) = (values.len(), values[0].len());
        let mut sent = vec![vec![Vec::new(); ranks]; ranks]; // [from][to]
        for r in 0..ranks {
            for (to, msg) in sent[r].iter_mut().enumerate() {
                let c = chunk(n, ranks, to);
                let fed: Vec<f32> = c.clone().map(|i| values[r][i] + residuals[r][i]).collect();
                let mut lost = vec![0.0; c.len()];
                quantize(&fed, &mut lost, msg);
                residuals[r][c].copy_from_slice(&lost);
            }
        }
        let mut mean = vec![0.0; n];
        for owner in 0..ranks {
            let c = chunk(n, ranks, owner);
            let mut sum = vec![0.0f32; c.len()];
            for from in sent.iter() {
                add_decoded(&from[owner], &mut sum);
            }
            for (s, e) in sum.iter_mut().zip(&residuals[owner][n..]) {
                *s += e;
            }
            let mut lost = vec![0.0; c.len()];
            let mut msg = Vec::new();
            quantize(&sum, &mut lost, &mut msg);
            residuals[owner][n..].copy_from_slice(&lost);
            add_decoded(&msg, &mut mean[c]);
        }
        mean
    }

    #[test]
    fn the_mean_equals_the_sequential_oracle_bit_for_bit_over_three_meetings() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for (ranks, n) in [(2, 1000), (3, 1031), (4, 3), (4, 0), (3, 257)] {
            let comms = Communicator::in_process(
                ranks,
                CommConfig {
                    timeout: Duration::from_secs(20),
                    ..CommConfig::default()
                },
            );
            let mut residuals: Vec<Vec<f32>> = (0..ranks)
                .map(|r| vec![0.0; n + chunk(n, ranks, r).len()])
                .collect();
            let mut theirs = residuals.clone();
            let mut comms = comms.into_iter().map(Some).collect::<Vec<_>>();
            for meeting in 0..3 {
                let values: Vec<Vec<f32>> = (0..ranks)
                    .map(|_| {
                        (0..n)
                            .map(|_| rng.random_range(-1.0f32..1.0) * 1e-2)
                            .collect()
                    })
                    .collect();
                let expected = oracle(&values, &mut residuals);
                let handles: Vec<_> = (0..ranks)
                    .map(|r| {
                        let comm = comms[r].take().unwrap();
                        let v = values[r].clone();
                        let mut res = std::mem::take(&mut theirs[r]);
                        std::thread::spawn(move || {
                            let (mean, bytes) = mean(&comm, &v, &mut res).expect("mean");
                            (comm, mean, bytes, res)
                        })
                    })
                    .collect();
                for (r, h) in handles.into_iter().enumerate() {
                    let (comm, got, bytes, res) = h.join().unwrap();
                    assert!(
                        got == expected,
                        "ranks {ranks}, n {n}, meeting {meeting}: rank {r}'s mean differs"
                    );
                    assert!(res == residuals[r], "rank {r}'s kept error differs");
                    let whole: usize = (0..ranks)
                        .map(|o| message_len(chunk(n, ranks, o).len()))
                        .sum();
                    assert_eq!(bytes, whole);
                    comms[r] = Some(comm);
                    theirs[r] = res;
                }
                // The mean is close to the exact one: each stage loses at most half a step.
                for (i, e) in expected.iter().enumerate() {
                    let exact: f32 = values.iter().map(|v| v[i]).sum();
                    assert!((e - exact).abs() < 2e-3, "{e} against {exact}");
                }
            }
        }
    }
}
