"""Speculative decoding: proposers of draft tokens. Verification (exact by construction) is
``sampling.sampler.verify``; rollback of rejected drafts is ``Scheduler.update``."""
