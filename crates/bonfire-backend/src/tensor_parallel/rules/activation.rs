//! Activations: elementwise (they keep the placement), and the softmax family written as its
//! reductions, so that a softmax over a split dimension (a vocabulary-parallel output) reduces
//! over the group instead of gathering the logits.

use burn_backend::{Backend, Scalar};

use super::{
    binary, float_detach, float_div, float_exp, float_log, float_max_dim, float_neg, float_sub,
    float_sum_dim, unary,
};
use crate::tensor_parallel::tensor::TpTensor;

pub(crate) fn gelu<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "gelu", I::gelu)
}

pub(crate) fn relu<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "relu", I::relu)
}

pub(crate) fn sigmoid<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "sigmoid", I::sigmoid)
}

pub(crate) fn log_sigmoid<I: Backend>(tensor: TpTensor<I>) -> TpTensor<I> {
    unary::<I>(tensor, "log_sigmoid", I::log_sigmoid)
}

pub(crate) fn leaky_relu<I: Backend>(tensor: TpTensor<I>, negative_slope: Scalar) -> TpTensor<I> {
    unary::<I>(tensor, "leaky_relu", |t| I::leaky_relu(t, negative_slope))
}

pub(crate) fn hard_sigmoid<I: Backend>(
    tensor: TpTensor<I>,
    alpha: Scalar,
    beta: Scalar,
) -> TpTensor<I> {
    unary::<I>(tensor, "hard_sigmoid", |t| I::hard_sigmoid(t, alpha, beta))
}

pub(crate) fn gelu_backward<I: Backend>(x: TpTensor<I>, grad: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(x, grad, "gelu_backward", None, I::gelu_backward)
}

pub(crate) fn relu_backward<I: Backend>(output: TpTensor<I>, grad: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(output, grad, "relu_backward", None, I::relu_backward)
}

pub(crate) fn sigmoid_backward<I: Backend>(output: TpTensor<I>, grad: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(output, grad, "sigmoid_backward", None, I::sigmoid_backward)
}

pub(crate) fn log_sigmoid_backward<I: Backend>(x: TpTensor<I>, grad: TpTensor<I>) -> TpTensor<I> {
    binary::<I>(
        x,
        grad,
        "log_sigmoid_backward",
        None,
        I::log_sigmoid_backward,
    )
}

/// `exp(x - max) / sum(exp(x - max))` over `dim`.
pub(crate) fn softmax<I: Backend>(tensor: TpTensor<I>, dim: usize) -> TpTensor<I> {
    let max = float_max_dim::<I>(float_detach::<I>(tensor.clone()), dim);
    let exp = float_exp::<I>(float_sub::<I>(tensor, max));
    let sum = float_sum_dim::<I>(exp.clone(), dim);
    float_div::<I>(exp, sum)
}

/// `(x - max) - log(sum(exp(x - max)))` over `dim`.
pub(crate) fn log_softmax<I: Backend>(tensor: TpTensor<I>, dim: usize) -> TpTensor<I> {
    let max = float_max_dim::<I>(float_detach::<I>(tensor.clone()), dim);
    let shifted = float_sub::<I>(tensor, max);
    let log_sum_exp = float_log::<I>(float_sum_dim::<I>(float_exp::<I>(shifted.clone()), dim));
    float_sub::<I>(shifted, log_sum_exp)
}

pub(crate) fn softmin<I: Backend>(tensor: TpTensor<I>, dim: usize) -> TpTensor<I> {
    softmax::<I>(float_neg::<I>(tensor), dim)
}
