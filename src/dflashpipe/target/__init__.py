"""The frozen target: materialised once by its stage, then run by every stage that needs it.

One job per module, imported by its full name (this file re-exports nothing, so a stage that only runs the
target depends on none of the materialising code, and only regenerate on the batching):
- `materialise`: the `target` stage: the source resolved, dequantised and saved into data/target/;
- `weights`: where the weights are (data/target/, or the user's directory read in place), checked before a load;
- `dtype`: the dtype the target computes in on a device (`compute.target_dtype`);
- `adapter`: `Target`, the target loaded from data/target/, and its passes over a KV cache;
- `chat`: the target's tokenizer and chat template, and where the assistant replies lie in a rendering
  (regenerate renders the prompts with it, tokenize the conversations, evaluate and serve the eval prompts);
- `batching`: continuous batching of greedy replies (regenerate);
- `hidden_states`: the hand-written decoder pass that gives the drafter's layers' hidden states (features, train).
"""
