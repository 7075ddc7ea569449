"""Write docs/settings.md from the settings table in deltafin/settings.py.

    python tools/settings_doc.py

Run it after changing a setting or its help text; tests/test_docs.py fails while the page is stale.
"""
from pathlib import Path

from deltafin.settings import settings_markdown

PAGE = Path(__file__).resolve().parent.parent / "docs" / "settings.md"

if __name__ == "__main__":
    PAGE.write_text(settings_markdown())
    print(f"wrote {PAGE}")
