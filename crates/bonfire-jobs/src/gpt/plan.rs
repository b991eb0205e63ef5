//! What the bundled GPT-style model ([`bonfire_models::Gpt`]) needs to train distributed,
//! beside the model itself (which knows nothing of bonfire): its tensor-parallel plan.

use bonfire::TpPlan;

/// The standard Megatron split of [`bonfire_models::Gpt`]: each block's attention by heads (the
/// query, key and value projections by columns, the output projection by rows) and its MLP by
/// hidden features (`fc1` by columns, `fc2` by rows); the token embedding, and so the head tied
/// to it, by vocabulary, so that the cross-entropy never gathers the logits. The position
/// embedding and the layer norms stay whole. The heads, the MLP width (4 x the model width) and
/// the vocabulary must divide by the tensor-parallel size; applying the plan says which does not.
///
/// An untied head (`GptConfig::with_tied(false)`) needs `.column("head")` as well.
pub fn plan() -> TpPlan {
    stage_plan(true)
}

/// [`plan`] for a pipeline stage ([`bonfire_models::GptStage`]): its blocks' rules, and the
/// token embedding's when the stage holds it (the first stage, and the last one's copy for a
/// tied head). A plan's rule must match a parameter, and a middle stage has no embedding.
pub fn stage_plan(token_embedding: bool) -> TpPlan {
    let plan = if token_embedding {
        TpPlan::new().vocab("tok")
    } else {
        TpPlan::new()
    };
    plan.column("blocks.*.attn.query")
        .column("blocks.*.attn.key")
        .column("blocks.*.attn.value")
        .row("blocks.*.attn.output")
        .column("blocks.*.mlp.fc1")
        .row("blocks.*.mlp.fc2")
}
