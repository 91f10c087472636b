"""The maths of TP-GRPO as pure functions on tensors: the sigma schedule, sampler steps with log-probs,
trajectory loops, probe modes, credit (incremental and aggregated rewards, turning points), advantages,
the clipped policy loss and the per-sample seeds. No file I/O here."""
