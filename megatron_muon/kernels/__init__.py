from .backends import available_backends, batched_newton_schulz
