"""Gated DeltaNet-2: Gated DeltaNet's delta rule with its erase and its write decoupled by separate
per-channel gates ("Linear Attention Architectures: Mechanisms, Trade-offs, and Cross-Layer Routing",
the study behind issue 15: which key channels are erased, which value channels are written).

With S [d_k, d_v] per head (this code base's layout), alpha_t the scalar decay of Gated DeltaNet,
beta_t its step size (kept: the shared strength of the update), an erase gate e_t over key channels
and a write gate w_t over value channels:

    S_t = alpha_t (S_{t-1} - beta_t (e_t * k_t)(k_t^T S_{t-1})) + beta_t k_t (w_t * v_t)^T
        = alpha_t (I - beta_t (e_t * k_t) k_t^T) S_{t-1} + beta_t k_t (w_t * v_t)^T
    o_t = S_t^T q_t,   log alpha_t = -exp(A_log) * softplus(W_a x + dt_bias),
    e_t = sigmoid(W_e x + b_e) in (0, 1)^{H d_k},  w_t = sigmoid(W_w x + b_w) in (0, 1)^{H d_v}.

The prediction k^T S is read with the whole key; only the erased key channels (e) are corrected,
and only the written value channels (w) receive the new value. e = w = 1 is Gated DeltaNet. The
transition is an asymmetric rank-one update (diagonal-plus-low-rank, like fla's
generalized_delta_rule); the chunked form (edgelin.reference.recurrence.chunked, erase=...) solves
one unit lower-triangular system per chunk for the read rows. The write gate folds into v, so the
engines only take the erase gate. State: as Gated DeltaNet's (recurrent_state [H, d_k, d_v] and
the short-conv state); the gates add parameters, not state.

Init: W_e = W_w = 0 and b_e = b_w = 3, so every gate is sigmoid(3) ~ 0.953 for every token and a
fresh GDN-2 layer IS a Gated DeltaNet layer with beta scaled by 0.953; training moves off it.
"""

from edgelin.families.spec import Decay, FamilySpec, Gate, OutputGate

SPEC = FamilySpec(
    name="gated_deltanet2",
    summary="Gated DeltaNet + per-key-channel erase and per-value-channel write gates",
    qk_norm="l2",
    short_conv=True,
    decay=Decay.SCALAR,
    gate=Gate.SOFTPLUS,
    delta_rule=True,
    erase_gate=True,
    write_gate=True,
    output_norm=True,
    output_gate=OutputGate.AFTER_NORM,
    chunk_size=32,
)
