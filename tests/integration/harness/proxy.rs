//! A TCP proxy between one pgleader and the server, that can freeze traffic (a partition
//! without RST or FIN: bytes simply stop flowing, both ways), delay the server's answers (a
//! slow path back: what the server did, it did at once; the client learns it late), and cut
//! every connection.
//!
//! Note what a user-space proxy cannot do: while frozen, its own kernel still acknowledges
//! the server's TCP keepalives, so the server never sees the partition at the TCP level. The
//! tests therefore rely on the lease's `idle_session_timeout` for the server's side.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    frozen: bool,
    /// Bumped by `cut`: pumps of an older generation stop.
    generation: u64,
    connections: Vec<TcpStream>,
    /// How long each chunk from the server is held before it is passed on.
    reply_delay: Duration,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `upstream_port` there.
    pub fn start(upstream_port: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("address").port();
        let upstream: SocketAddr = ([127, 0, 0, 1], upstream_port).into();
        let shared = Arc::new(Shared::default());
        let accept_shared = shared.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let generation = {
                    let mut state = accept_shared.state.lock().expect("proxy lock");
                    state.connections.push(client.try_clone().expect("clone"));
                    state.connections.push(server.try_clone().expect("clone"));
                    state.generation
                };
                pump(&client, &server, generation, accept_shared.clone(), false);
                pump(&server, &client, generation, accept_shared.clone(), true);
            }
        });
        Proxy { port, shared }
    }

    /// The port it listens on, on 127.0.0.1 (the benchmark puts etcd behind it too).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL that reaches the cluster through this proxy.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port())
    }

    /// Stops forwarding in both directions; connections stay open.
    pub fn freeze(&self) {
        self.shared.state.lock().expect("proxy lock").frozen = true;
        self.shared.changed.notify_all();
    }

    /// Resumes forwarding.
    pub fn thaw(&self) {
        self.shared.state.lock().expect("proxy lock").frozen = false;
        self.shared.changed.notify_all();
    }

    /// Holds every chunk the server sends for `delay` before passing it on, in order (0: at
    /// once). What the client sends still reaches the server at once.
    pub fn delay_replies(&self, delay: Duration) {
        self.shared.state.lock().expect("proxy lock").reply_delay = delay;
    }

    /// Resets every connection open now (RST to both sides). New connections still work.
    pub fn cut(&self) {
        let mut state = self.shared.state.lock().expect("proxy lock");
        state.generation += 1;
        for stream in state.connections.drain(..) {
            reset(&stream);
        }
        self.shared.changed.notify_all();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.thaw();
        self.cut();
    }
}

/// Copies `from` to `to` until either side closes, holding data back while frozen, and, when
/// it comes from the server (`replies`), for the reply delay.
fn pump(from: &TcpStream, to: &TcpStream, generation: u64, shared: Arc<Shared>, replies: bool) {
    let mut from = from.try_clone().expect("clone");
    let mut to = to.try_clone().expect("clone");
    let to_reset = to.try_clone().expect("clone");
    // The reader stamps each chunk with when it may go on; the writer keeps the order.
    let (chunks, queued) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer_shared = shared.clone();
    thread::spawn(move || {
        for (due, chunk) in queued {
            thread::sleep(due.saturating_duration_since(Instant::now()));
            // Data that arrived just as the proxy froze is held until it thaws.
            if !wait_while_frozen(&writer_shared, generation) || to.write_all(&chunk).is_err() {
                return;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            if !wait_while_frozen(&shared, generation) {
                return;
            }
            let n = match from.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => n,
                Err(err) if err.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    reset(&to_reset);
                    return;
                }
            };
            let delay = if replies {
                shared.state.lock().expect("proxy lock").reply_delay
            } else {
                Duration::ZERO
            };
            if chunks
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                return;
            }
        }
    });
}

/// Blocks while frozen; false if the connection was cut meanwhile.
fn wait_while_frozen(shared: &Shared, generation: u64) -> bool {
    let mut state = shared.state.lock().expect("proxy lock");
    while state.frozen && state.generation == generation {
        state = shared.changed.wait(state).expect("proxy lock");
    }
    state.generation == generation
}

/// Closes with SO_LINGER 0, so the peer gets an RST rather than a FIN.
fn reset(stream: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket descriptor and a correctly sized linger struct.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    let _ = stream.shutdown(Shutdown::Both);
}
