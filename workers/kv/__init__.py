"""The paged KV cache, automatic prefix caching, and KV export (prefill) / import (decode) through connectors."""
