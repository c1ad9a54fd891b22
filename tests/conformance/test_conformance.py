"""Every installed transport against the conformance kit, between two processes."""


def test_conformance(mpcomm_conformance, mpcomm_check):
    mpcomm_check(mpcomm_conformance)
