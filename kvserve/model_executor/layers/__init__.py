"""Building blocks of the model code: RMSNorm, rotary embedding, paged attention."""
