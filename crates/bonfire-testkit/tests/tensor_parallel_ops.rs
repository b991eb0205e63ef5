//! Random chains of ops on `TensorParallel<Flex>` against the same chains on plain `Flex`: every
//! input of the chain is given a random placement (whole, split along a random dimension, or a
//! partial sum of random terms), and the chain's result, read whole, must equal the plain one
//! (within 1e-4: the ranks sum in another order). Ranks are threads of this process.

use std::time::Duration;

use bonfire::backend::tensor_parallel::{bind_thread, distribute, from_terms};
use bonfire::collectives::{CommConfig, Communicator};
use bonfire::{Placement, TensorParallel};
use bonfire_testkit::run_ranks;
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

type Flex = burn::backend::Flex;
type Tp = TensorParallel<Flex>;

/// A fresh input's placement, by kind (resolved against its shape and the group's size).
#[derive(Clone, Copy, Debug)]
enum Place {
    Whole,
    Split(usize),
    Partial,
}

#[derive(Clone, Debug)]
enum Op {
    Unary(u8),
    Scalar(u8, f32),
    /// With a fresh input of the same shape, or of size 1 along the dimension given.
    Binary(u8, Place, Option<usize>),
    Reduce(u8, usize),
    Swap(usize, usize),
    Softmax(usize, bool),
    Matmul(Place),
    Narrow(usize),
    Cat(usize, Place),
    MaskFill(usize),
    Gather(usize),
}

fn place() -> impl Strategy<Value = Place> {
    prop_oneof![
        Just(Place::Whole),
        (0usize..3).prop_map(Place::Split),
        Just(Place::Partial)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..5).prop_map(Op::Unary),
        (0u8..4, -2.0f32..2.0).prop_map(|(k, s)| Op::Scalar(k, s)),
        (0u8..4, place(), proptest::option::of(0usize..3))
            .prop_map(|(k, p, b)| Op::Binary(k, p, b)),
        (0u8..4, 0usize..3).prop_map(|(k, d)| Op::Reduce(k, d)),
        (0usize..3, 0usize..3).prop_map(|(a, b)| Op::Swap(a, b)),
        (0usize..3, any::<bool>()).prop_map(|(d, l)| Op::Softmax(d, l)),
        place().prop_map(Op::Matmul),
        (0usize..3).prop_map(Op::Narrow),
        (0usize..3, place()).prop_map(|(d, p)| Op::Cat(d, p)),
        (0usize..3).prop_map(Op::MaskFill),
        (0usize..3).prop_map(Op::Gather),
    ]
}

/// Placing a whole tensor: only the tensor-parallel backend does (the plain run never asks).
trait Place3: Backend {
    fn split(t: Tensor<Self, 3>, dim: usize) -> Tensor<Self, 3>;
    fn terms(t: Tensor<Self, 3>) -> Tensor<Self, 3>;
}

impl Place3 for Flex {
    fn split(t: Tensor<Self, 3>, _: usize) -> Tensor<Self, 3> {
        t
    }
    fn terms(t: Tensor<Self, 3>) -> Tensor<Self, 3> {
        t
    }
}

impl Place3 for Tp {
    fn split(t: Tensor<Self, 3>, dim: usize) -> Tensor<Self, 3> {
        distribute(t, Placement::shard(dim))
    }
    fn terms(t: Tensor<Self, 3>) -> Tensor<Self, 3> {
        from_terms(t)
    }
}

/// Makes the chain's fresh inputs: the same values for the plain run and every rank, placed as
/// asked on the ranks.
struct Inputs {
    rng: ChaCha8Rng,
    /// (rank, ranks) for a tensor-parallel run; `None` for the plain run.
    rank: Option<(usize, usize)>,
}

impl Inputs {
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| self.rng.random_range(-1.0f32..1.0))
            .collect()
    }

    fn float<B: Place3>(
        &mut self,
        shape: [usize; 3],
        place: Place,
        device: &B::Device,
    ) -> Tensor<B, 3> {
        let n = shape.iter().product();
        let values = self.values(n);
        let whole = Tensor::<B, 3>::from_data(TensorData::new(values.clone(), shape), device);
        let Some((rank, ranks)) = self.rank else {
            // Keep the generator in step with the ranks, which draw the partial terms.
            if matches!(place, Place::Partial) {
                let _ = self.values(n * 4);
            }
            return whole;
        };
        match place {
            Place::Whole => whole,
            Place::Split(d) if shape[d].is_multiple_of(ranks) => B::split(whole, d),
            Place::Split(_) => whole,
            Place::Partial => {
                // Rank r's term: noise r (r > 0), and the value minus all the noise on rank 0.
                let noise = self.values(n * 4);
                let term: Vec<f32> = (0..n)
                    .map(|i| {
                        if rank == 0 {
                            values[i] - (1..ranks).map(|r| noise[(r - 1) * n + i]).sum::<f32>()
                        } else {
                            noise[(rank - 1) * n + i]
                        }
                    })
                    .collect();
                B::terms(Tensor::<B, 3>::from_data(
                    TensorData::new(term, shape),
                    device,
                ))
            }
        }
    }
}

fn apply<B: Place3>(
    x: Tensor<B, 3>,
    op: &Op,
    inputs: &mut Inputs,
    device: &B::Device,
) -> Tensor<B, 3> {
    let shape = x.dims();
    match *op {
        Op::Unary(0) => x.tanh(),
        Op::Unary(1) => -x,
        Op::Unary(2) => burn::tensor::activation::sigmoid(x),
        Op::Unary(3) => burn::tensor::activation::gelu(x),
        Op::Unary(_) => (x.clamp(-3.0, 3.0)).exp(),
        Op::Scalar(0, s) => x * s,
        Op::Scalar(1, s) => x + s,
        Op::Scalar(2, s) => x / (s.abs() + 0.5),
        Op::Scalar(_, s) => x - s,
        Op::Binary(k, p, b) => {
            let mut s = shape;
            if let Some(d) = b {
                s[d] = 1;
            }
            let y = inputs.float::<B>(s, p, device);
            match k {
                0 => x + y,
                1 => x * y,
                2 => x - y,
                _ => y - x,
            }
        }
        Op::Reduce(k, d) => {
            let r = match k {
                0 => x.sum_dim(d),
                1 => x.mean_dim(d),
                2 => x.max_dim(d),
                _ => x.min_dim(d),
            };
            // Back to the chain's size, through a broadcast add.
            r + inputs.float::<B>(shape, Place::Whole, device)
        }
        Op::Swap(a, b) => x.swap_dims(a, b),
        Op::Softmax(d, false) => softmax(x, d),
        Op::Softmax(d, true) => log_softmax(x, d),
        Op::Matmul(p) => {
            let w = inputs.float::<B>([shape[0], shape[2], 4], p, device);
            x.matmul(w)
        }
        Op::Narrow(d) => {
            if shape[d] < 4 {
                return x;
            }
            x.narrow(d, 0, shape[d] / 2)
        }
        Op::Cat(d, p) => {
            if shape[d] > 16 {
                return x;
            }
            let y = inputs.float::<B>(shape, p, device);
            Tensor::cat(vec![x, y], d)
        }
        Op::MaskFill(d) => {
            let mut s = shape;
            s[d] = 1;
            let bits: Vec<bool> = inputs
                .values(s.iter().product())
                .iter()
                .map(|v| *v > 0.0)
                .collect();
            let mask = Tensor::<B, 3, Bool>::from_data(TensorData::new(bits, s), device);
            x.mask_fill(mask, 0.25)
        }
        Op::Gather(d) => {
            let n: usize = shape.iter().product();
            let idx: Vec<i64> = inputs
                .values(n)
                .iter()
                .map(|v| (((v + 1.0) / 2.0) * shape[d] as f32) as i64 % shape[d] as i64)
                .collect();
            let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(idx, shape), device);
            x.gather(d, idx)
        }
    }
}

fn run_chain<B: Place3>(
    seed: u64,
    first: Place,
    ops: &[Op],
    rank: Option<(usize, usize)>,
) -> (Vec<usize>, Vec<f32>) {
    let device = B::Device::default();
    let mut inputs = Inputs {
        rng: ChaCha8Rng::seed_from_u64(seed),
        rank,
    };
    let mut x = inputs.float::<B>([4, 4, 8], first, &device);
    for op in ops {
        x = apply::<B>(x, op, &mut inputs, &device);
    }
    let data = x.into_data();
    (
        data.shape.to_vec(),
        data.convert::<f32>().into_vec::<f32>().expect("f32"),
    )
}

fn check(seed: u64, tp: usize, first: Place, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let (want_shape, want) = run_chain::<Flex>(seed, first, &ops, None);
    let chain = ops.clone();
    let got = run_ranks(
        Communicator::in_process(
            tp,
            CommConfig {
                timeout: Duration::from_secs(20),
                ..CommConfig::default()
            },
        ),
        Duration::from_secs(60),
        move |comm| {
            let (rank, ranks) = (comm.rank(), comm.size());
            let _group = bind_thread(comm).expect("bind");
            run_chain::<Tp>(seed, first, &chain, Some((rank, ranks)))
        },
    );
    for (rank, (shape, values)) in got.into_iter().enumerate() {
        prop_assert_eq!(&shape, &want_shape, "rank {} shape, ops {:?}", rank, ops);
        let d = values
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
            .fold(0.0f32, f32::max);
        prop_assert!(d <= 1e-4, "rank {} differs by {} after {:?}", rank, d, ops);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn random_op_chains_equal_the_plain_backend(
        seed in any::<u64>(),
        tp in prop_oneof![Just(2usize), Just(4usize)],
        first in place(),
        ops in proptest::collection::vec(op(), 1..6),
    ) {
        check(seed, tp, first, ops)?;
    }
}
