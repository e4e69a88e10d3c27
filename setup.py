"""Install yatt-hpc.

    make install          # .venv with the CPU torch build and the [dev] extra, at constraints/lock.txt
    pip install -e '.[dev]'
    pip install -e '.[gpu]'   # adds SGLang (CUDA machines only)
    pip install -e '.[trackers]'  # adds Weights & Biases and MLflow (logging.trackers)

The ranges here are for library users. ``make install`` installs the exact versions of
``constraints/lock.txt`` (``uv pip compile`` output; ``make lock`` refreshes it), torch first and pinned
to the CPU build so that pip never resolves a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

setup(
    name="yatt-hpc",
    version="0.1.0",
    description="Slurm-native RL post-training with parallel MPI controllers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["yatt_hpc", "yatt_hpc.*"]),
    package_data={"yatt_hpc": ["py.typed"]},
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.17",
        "psutil>=5.9",  # megatron-core needs it but does not declare it
        "transformers>=4.50",
        "mpi4py>=4.0",
        "submitit>=1.5.4",
        "h5py>=3.10",
        "pyarrow>=14",  # Parquet prompt datasets (data.source); row groups and column subsets read lazily
        "safetensors>=0.4",
        "tensorboard>=2.16",
        "click>=8.1",
        "pydantic>=2.6,<3",
        "PyYAML>=6.0",
        "rich>=13.0",
        "numpy>=1.26",
        "pillow>=10",  # images of multimodal datasets (yatt_hpc/vision): header checks, decoding, the shapes demo
        "matplotlib>=3.8",
        "math-verify>=0.9,<1",  # the `math` reward term (HF's answer extraction + equivalence; latex2sympy2_extended)
    ],
    extras_require={
        # experiment trackers beside TensorBoard (logging.trackers): W&B, and MLflow's client with its SQLite store
        "trackers": ["wandb>=0.19", "mlflow-skinny>=3.0", "sqlalchemy>=2.0", "alembic>=1.13"],
        # uv: `make lock`; the trackers again: their tests run the real libraries (tests/unit/test_lock.py checks);
        # peft: the LoRA tests load our exported adapters with the real library (never imported by yatt_hpc)
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "ruff>=0.5", "uv>=0.5",
                "wandb>=0.19", "mlflow-skinny>=3.0", "sqlalchemy>=2.0", "alembic>=1.13", "peft>=0.15"],
        "gpu": ["sglang>=0.5.3", "torch_memory_saver"],  # 0.5.3: sampling_seed, weights CPU backup
    },
    entry_points={"console_scripts": ["yatt-hpc=yatt_hpc.cli:main"]},
)
