"""The Streamlit dashboard over a grading lake (``foretoken dashboard --lake DIR``)."""

from pathlib import Path

# What `streamlit run` runs (the CLI, the demo and the tests start it from here).
APP_PATH = Path(__file__).resolve().parent / "app.py"
