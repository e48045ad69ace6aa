"""Shared test helpers: tiny random-weight models, SmolLM2 fixtures, attention batch cases."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_CONFIG = os.path.join(REPO, "configs", "tiny-test.yaml")
