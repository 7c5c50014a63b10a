"""Float64 numpy references for every hss kernel (imports only numpy and ml_dtypes)."""
