"""operations: batch priority, pause, late acceptance and ETA; measured throughput; webhooks and their outbox

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('batches', sa.Column('priority', sa.Integer(), server_default='0', nullable=False))
    op.add_column('batches', sa.Column('paused_at', sa.BigInteger(), nullable=True))
    op.add_column('batches', sa.Column('allow_late', sa.Boolean(), server_default=sa.text('false'), nullable=False))
    op.add_column('batches', sa.Column('estimated_completion_at', sa.BigInteger(), nullable=True))
    op.create_table('throughput',
    sa.Column('model', sa.String(length=512), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('rows_per_second', sa.Float(), nullable=False),
    sa.Column('tokens_per_second', sa.Float(), nullable=False),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.Column('updated_at', sa.BigInteger(), nullable=False),
    sa.CheckConstraint('rows_per_second > 0 AND tokens_per_second >= 0', name=op.f('ck_throughput_rates')),
    sa.PrimaryKeyConstraint('model', 'endpoint', name=op.f('pk_throughput'))
    )
    op.create_table('webhooks',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('events_json', sa.Text(), nullable=False),
    sa.Column('secret', sa.String(length=128), nullable=False),
    sa.Column('owner_key_id', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhooks'))
    )
    op.create_table('webhook_outbox',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('event_id', sa.String(length=64), nullable=False),
    sa.Column('webhook_id', sa.String(length=64), nullable=False),
    sa.Column('event_type', sa.String(length=32), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('payload', sa.Text(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.BigInteger(), nullable=False),
    sa.Column('delivered_at', sa.BigInteger(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('claimed_by', sa.String(length=128), nullable=True),
    sa.CheckConstraint("state IN ('pending', 'delivered', 'failed')", name=op.f('ck_webhook_outbox_state')),
    sa.ForeignKeyConstraint(['webhook_id'], ['webhooks.id'], name=op.f('fk_webhook_outbox_webhook_id_webhooks'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_outbox'))
    )
    op.create_index('ix_webhook_outbox_due', 'webhook_outbox', ['next_attempt_at'], unique=False, postgresql_where=sa.text("state = 'pending'"), sqlite_where=sa.text("state = 'pending'"))


def downgrade() -> None:
    op.drop_index('ix_webhook_outbox_due', table_name='webhook_outbox', postgresql_where=sa.text("state = 'pending'"), sqlite_where=sa.text("state = 'pending'"))
    op.drop_table('webhook_outbox')
    op.drop_table('webhooks')
    op.drop_table('throughput')
    with op.batch_alter_table('batches') as batch_op:
        batch_op.drop_column('estimated_completion_at')
        batch_op.drop_column('allow_late')
        batch_op.drop_column('paused_at')
        batch_op.drop_column('priority')
