"""Where the real datasets are for the tests that read them: ``shared/data`` beside the checkout.

CI has the folder and users don't: every test that reads it skips, naming the path, when it is absent.
"""

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
