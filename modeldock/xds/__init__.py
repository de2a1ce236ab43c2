"""The xDS control plane: EDS clusters per model, served over ADS to Envoy and ext_proc."""
