"""Token loops: sampling, contrastive scores, speculative verification and the decode-state pytree."""
