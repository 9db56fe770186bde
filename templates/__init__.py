"""Jinja2 templates of the emitted files (read as data by generator.render)."""
