//! The codec of the connector's server side: prost, except that a request which does not
//! decode (invalid UTF-8 in a string field, a truncated field, a wrong wire type) is the
//! caller's error, `INVALID_ARGUMENT`, not the `INTERNAL` tonic answers by default. The
//! controller's client keeps tonic's default: a reply it cannot decode is the node's fault.

use prost::Message;
use std::marker::PhantomData;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstEncoder};

/// Encodes replies as prost does; decodes requests with [`RequestDecoder`].
#[derive(Debug, Clone)]
pub struct RequestCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for RequestCodec<T, U> {
    fn default() -> Self {
        Self {
            _types: PhantomData,
        }
    }
}

impl<T, U> Codec for RequestCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = RequestDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder {
            _message: PhantomData,
        }
    }
}

/// Decodes one request message; a message that is not valid protobuf for its type answers
/// `INVALID_ARGUMENT` naming the message and the field prost stopped at.
#[derive(Debug)]
pub struct RequestDecoder<U> {
    _message: PhantomData<U>,
}

impl<U: Message + Default + Send + 'static> Decoder for RequestDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|error| {
            let name = std::any::type_name::<U>();
            let name = name.rsplit("::").next().unwrap_or(name);
            Status::invalid_argument(format!(
                "the request is not a valid {name} message ({error}); send it as the proto defines it"
            ))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}
