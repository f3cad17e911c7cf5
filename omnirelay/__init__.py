"""omnirelay: disaggregated serving for omni-modality models.

The top-level folders of the repository (broker/, workers/, connectors/, gateway/, deploy/) are the
subpackages ``omnirelay.broker`` … mapped in pyproject.toml, so no generic top-level name lands in
site-packages.
"""

__version__ = "0.1.0"
