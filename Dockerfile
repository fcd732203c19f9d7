# The foretoken services' image (used by docker-compose.yml).
#
# Stage 1 builds the native extension (native/: Rust + PyO3, built by maturin from PyPI,
# crates from crates.io) into a wheel, with the Rust toolchain of the official rust image;
# the final image gets the wheel only, not the toolchain.
FROM rust:1-slim-bookworm AS rust
FROM python:3.11-slim AS native
COPY --from=rust /usr/local/cargo /usr/local/cargo
COPY --from=rust /usr/local/rustup /usr/local/rustup
ENV CARGO_HOME=/usr/local/cargo RUSTUP_HOME=/usr/local/rustup PATH=/usr/local/cargo/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY native /src/native
RUN pip wheel --no-cache-dir --wheel-dir /wheels /src/native

FROM python:3.11-slim
WORKDIR /app
COPY --from=native /wheels /wheels
COPY . /app
RUN pip install --no-cache-dir /wheels/*.whl . && rm -rf /wheels
ENV PYTHONUNBUFFERED=1
CMD ["foretoken", "--help"]
