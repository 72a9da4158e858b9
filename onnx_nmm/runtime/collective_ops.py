"""The ONNX ops that join the rank programs of a model split over NeuronCores (`compile --tp`):

    com.onnx_nmm::AllReduce(X)           the sum of X over every rank; every rank gets it
    com.onnx_nmm::AllGather(X, axis=-1)  every rank's X concatenated along `axis`, rank 0 first

trainium/graph_sharding.py writes them, lowering/collective_converters.py lowers them, runtime/rank_programs.py
runs them between ranks in one process.
"""

DOMAIN, DOMAIN_VERSION = "com.onnx_nmm", 1
ALL_REDUCE, ALL_GATHER = "AllReduce", "AllGather"
