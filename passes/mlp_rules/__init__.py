"""The MLP rules: one rule per form an exported MLP takes, each anchored at the MLP's output projection, its pattern
written as code (pattern.py), what it finds an Mlp (mlp.py). Narrowing, fusion and the Trainium shapes all find
MLPs with them (rule_set.py); pattern.RESHAPES is the one list of the reshapes an MLP may pass through.

    gated.py          y = down(f(gate(x), up(x)))                      Llama, Qwen, Gemma, Mistral
    split_gate_up.py  y = down(f(select(gate_up(x)), select(gate_up(x))))    Phi-3
    ungated.py        y = down(f(fc1(x)))                              GPT-2, Phi
"""
