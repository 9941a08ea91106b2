"""What a study says, for both products: records (``study.json``, ``branched.json``), the figures, the HTML
report, and where they are written (output)."""
