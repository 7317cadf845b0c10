"""Install metadata for mcp_context (hierarchical context-parallel attention for Megatron-Core)."""
from setuptools import find_packages, setup

setup(
    name="mcp_context",
    version="0.1.0",
    description=(
        "Megatron-Core compatible hierarchical context-parallel attention "
        "(Ulysses all-to-all inside, P2P rings outside) for 100K-1M+ token training"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mcp_context", "mcp_context.*", "megatron_patches", "megatron_patches.*"]),
    package_data={"mcp_context.data": ["corpus/*"], "mcp_context.plan": ["profiles/*.yaml"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.14",
        "sentencepiece",
        "pyyaml",
        "tqdm",
        "einops",  # megatron-core builds hierarchical CP groups with it but lists it only in extras
        "psutil",  # megatron-core's default (GPU) dist_checkpointing writer
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "hf": ["transformers>=4.40", "safetensors"],
        "bench": ["matplotlib"],
        "test": ["pytest", "pytest-xdist", "transformers>=4.40", "safetensors", "matplotlib"],
    },
    entry_points={"console_scripts": ["mcp-context-pretrain=mcp_context.pretrain:main"]},
)
