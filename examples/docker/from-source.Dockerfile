# pgleader built from source inside the image build, for those who would rather not use the
# release image (see Dockerfile beside this one for the usual way).
#
# Build from the repository's root (the build needs the sources):
#   docker build -f examples/docker/from-source.Dockerfile -t nightly-report .
#
# NOT built here: it starts from rust:1-bookworm and debian:bookworm-slim, and no image can be
# pulled on the machines this project is built on. `cargo test` checks that the files it
# copies exist; the static build it runs is the one scripts/release runs and checks.

# Any current stable Rust (pgleader needs 1.85 or later). ring, the TLS crypto, needs a C
# compiler, which this image has; no OpenSSL is needed.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# Statically linked (glibc static-pie), so it runs on any base image.
RUN CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --locked --target x86_64-unknown-linux-gnu

FROM debian:bookworm-slim
# ca-certificates: for sslrootcert=system (a managed database's public certificate).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/x86_64-unknown-linux-gnu/release/pgleader /usr/local/bin/pgleader
COPY --chmod=0755 examples/docker/nightly-report.sh /usr/local/bin/nightly-report
USER 10001:10001

ENV PGLEADER_LOCK=nightly-report
ENTRYPOINT ["/usr/local/bin/pgleader", "run"]
CMD ["--", "/usr/local/bin/nightly-report"]
