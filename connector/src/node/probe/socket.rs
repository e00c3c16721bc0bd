//! What every TCP probe shares: a connection bound to the probe address and the VNet device,
//! and a stream that refuses to read past its budget.

use super::ProbeResult;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpSocket, TcpStream};

/// A stream that refuses to read more than its budget: past it, reads fail and `exceeded` is
/// set, so the probe reports the cap rather than whatever error the protocol layer makes of it.
pub(super) struct Bounded<S> {
    pub(super) inner: S,
    pub(super) remaining: usize,
    pub(super) exceeded: Arc<AtomicBool>,
}

impl<S> Bounded<S> {
    pub(super) fn new(inner: S, budget: usize) -> Self {
        Self {
            inner,
            remaining: budget,
            exceeded: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Bounded<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.remaining == 0 {
            this.exceeded.store(true, Ordering::SeqCst);
            return Poll::Ready(Err(std::io::Error::other(
                "the probe's read budget is spent",
            )));
        }
        let mut chunk = [0u8; 8192];
        let want = buf.remaining().min(this.remaining).min(chunk.len());
        let Some(window) = chunk.get_mut(..want) else {
            return Poll::Ready(Ok(()));
        };
        let mut limited = ReadBuf::new(window);
        match Pin::new(&mut this.inner).poll_read(cx, &mut limited) {
            Poll::Ready(Ok(())) => {
                let got = limited.filled();
                this.remaining = this.remaining.saturating_sub(got.len());
                buf.put_slice(got);
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Bounded<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A TCP connection from `source` on `device` only.
pub(super) async fn connect(
    source: IpAddr,
    target: SocketAddr,
    device: &str,
) -> std::io::Result<TcpStream> {
    let socket = if source.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.bind_device(Some(device.as_bytes()))?;
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(target).await
}

pub(super) fn connect_failed(
    target: SocketAddr,
    error: &std::io::Error,
    started: Instant,
) -> ProbeResult {
    ProbeResult::failed(
        format!("connect to {target} failed: {error}"),
        started.elapsed(),
    )
}
