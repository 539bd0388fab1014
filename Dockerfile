# The image every loomray cluster node runs: Ray's own image with loomray installed, so pods and
# VMs start without a pip install (cluster/kuberay.yaml, cluster/kuberay-rayjob.yaml, cluster/aws.yaml).
#
#   docker build -t REGISTRY/loomray:0.1.0 .        # from the repository's root
#   docker build --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu -t REGISTRY/loomray:0.1.0-gpu .
#
# Keep RAY_IMAGE's Ray version equal to `rayVersion` in the KubeRay manifests (a test checks it).
# Agents the cluster runs are installed the same way: FROM this image, `pip install your-agents`.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311
FROM ${RAY_IMAGE}

# Only what the package is built from (see .dockerignore); the build happens in a throwaway folder.
COPY --chown=ray:users pyproject.toml README.md /tmp/loomray-src/
COPY --chown=ray:users loomray /tmp/loomray-src/loomray
COPY --chown=ray:users storage /tmp/loomray-src/storage

# The provider SDKs and fsspec readers are extras; Ray itself comes from the base image (same version).
RUN pip install --no-cache-dir "/tmp/loomray-src[anthropic,openai,fsspec]" \
    && rm -rf /tmp/loomray-src \
    && loomray --version
