"""Pure tensor math for post-training: advantages, policy losses, token logprobs.

Imports torch only: nothing here knows about models, files or HTTP.

Shape suffixes name tensor dimensions (nanochat style), used everywhere in posttrain:
    B  batch (datums / sequences)      T  tokens (positions in a sequence)
    G  group (completions of one prompt)  V  vocabulary      H  hidden size
So `logp_BT` is a [batch, tokens] tensor of log-probabilities, `adv_B` one advantage per
sequence, `rewards_G` one reward per completion in a group.
"""
